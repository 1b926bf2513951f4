"""`python -m colorl ...` is the `colorl` command (torchrun needs a module entry point)."""
import sys

from colorl.cli import main

sys.exit(main())
