"""An in-process engine library's own output goes to RUN_DIR/engine.log, not the screen.

vLLM logs every start-up stage, a warning per weight reload, and its start-up also writes C++
warnings, a progress bar and prints straight to the process's stdout and stderr; at exit its
libraries print leak reports. On the screen they would drown colorl's lines and splice into
them. So, for an engine that names its library's loggers (`Engine.log_names`):
- its start-up runs with this process's stdout and stderr (file descriptors 1 and 2) on the file;
- its loggers then write every record to the file and only errors, on their own line, to stderr;
- at interpreter exit (atexit: after everything colorl prints, before the libraries' teardown)
  descriptors 1 and 2 go to the file for good: what the libraries print at exit lands there too.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

LOG_FILE = "engine.log"


@dataclass(frozen=True)
class EngineLog:
    path: Path
    rank: int

    @classmethod
    def of_run(cls, run_dir: Path, rank: int) -> "EngineLog":
        return cls(Path(run_dir) / LOG_FILE, rank)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Everything this process writes to stdout and stderr inside the block goes to the file; an
        error raised in it says where to look."""
        saved = [os.dup(1), os.dup(2)]
        self._point_descriptors_at_file()
        try:
            yield
        except BaseException as exc:
            exc.add_note(f"the engine's own output: {self.path}")
            raise
        finally:
            _flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)

    def route(self, logger_names: tuple[str, ...]) -> None:
        """The library's loggers: every record to the file, errors also to stderr (one line each);
        its output at exit: to the file."""
        to_file = logging.FileHandler(self.path, encoding="utf-8")
        to_file.setFormatter(logging.Formatter(f"rank {self.rank} %(asctime)s %(levelname)s %(name)s: %(message)s"))
        to_screen = logging.StreamHandler(sys.stderr)
        to_screen.setLevel(logging.ERROR)
        to_screen.setFormatter(logging.Formatter(f"%(name)s (rank {self.rank}): %(levelname)s: %(message)s "
                                                 f"(more in {self.path})"))
        for name in logger_names:
            logger = logging.getLogger(name)
            logger.handlers[:] = [to_file, to_screen]
            logger.setLevel(logging.INFO)
            logger.propagate = False
        atexit.register(self._point_descriptors_at_file)

    def _point_descriptors_at_file(self) -> None:
        _flush()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
