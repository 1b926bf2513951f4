"""`python -m colorl ...` in a child process, started as a user's terminal would start it."""
import os
import signal
import subprocess
import sys


def start_colorl(argv: list[str], helpers: str) -> subprocess.Popen:
    """SIGINT gets its default disposition back: a test runner started as a background job (as CI
    may be) ignores SIGINT, and its children would inherit that and never see Ctrl-C."""
    env = dict(os.environ, PYTHONPATH=helpers + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "colorl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
