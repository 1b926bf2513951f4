"""The commands share their exit codes and one-line errors through colorl/exits.py: `plan`, `bench`
and `doctor` load without the command-line module (no import cycle through colorl/cli.py)."""
from __future__ import annotations

import subprocess
import sys


def test_commands_import_without_the_cli_module():
    code = ("import sys; import colorl.plan, colorl.bench.command, colorl.doctor; "
            "print('colorl.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fail_is_one_printable_line(capsys):
    from colorl.exits import EXIT_BAD_INPUT, fail

    assert fail("bad\nvalue\x1b[31m") == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err == "colorl: error: bad\\nvalue\\x1b[31m\n"
