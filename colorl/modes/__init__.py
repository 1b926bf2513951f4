"""Training modes by `mode` key."""
from colorl.modes.colocated import run_colocated

MODES = {"colocated": run_colocated}
