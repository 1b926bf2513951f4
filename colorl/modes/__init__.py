"""Training modes by `mode` key."""
from colorl.modes.bounded_lag import run_bounded_lag
from colorl.modes.colocated import run_colocated

MODES = {"colocated": run_colocated, "bounded_lag": run_bounded_lag}
