"""Which of two kernels this machine runs faster, measured once and kept (`cache_root()/kernels.json`), so
every process here (the ranks of a run, a run and its resume) computes with the same kernels.

A user's machine is often busy, and a race run beside a busy neighbour can be fooled: on a 2-core Xeon
every row count of the decode race took 20x its quiet time, and the kept verdict gave the 1-row product
to the slower kernel for good. So a race here:
- times each contender by its best of several alternating rounds (a neighbour only ever adds time, so the
  best round is the one it did not disturb);
- gives an item to the candidate only when it is faster by MARGIN: a near tie (0.00170 s against 0.00166 s)
  stays with the baseline instead of flipping with the noise;
- runs two passes and gives the candidate only the items it won in both (a third pass when they differ);
- watches what the rest of the machine did meanwhile (/proc/stat): a race during any pass of which other
  processes used the CPUs decides nothing. Beside neighbours on every core (2-core Zen 3, torch's OpenMP team
  oversubscribed) the best of five rounds still took 20x its quiet time, a tie was won by 6x and a 2x win
  was lost: such timings cannot be trusted at any margin. The baseline keeps every item, and the verdict
  is kept as provisional and raced again by the first process that finds the machine quiet.
Verdicts are keyed by the machine (colorl.machine.machine_key) and by the name the caller gives, which
names the thread count: a verdict at 2 threads does not decide for 1.

A quiet race can still be wrong for what a run does (a machine that changed under the same key, a race
fooled by what /proc/stat does not see), so a run also checks a verdict against its own timings of the
kernel it chose (`VerdictWatch`): a clear contradiction on a quiet machine marks the machine's verdict
stale, and the next process races it again. The run itself keeps computing with it (its record stays).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Hashable

MARGIN = 0.05  # the candidate must be this much faster to win an item
ROUNDS = 5
BUSY_CORES = 0.3  # other processes' average CPU use (in cores) above which a race is provisional
QUIET_PROBE_S = 0.1
CONTRADICTION = 2.0  # a run's own timing this many times the race's, for the kernel it chose, contradicts it
# (a decode step's layers also run attention, norms and calls the race does not: on a quiet Zen 3 at 2 threads
# they took 1.4-1.5x the race's products at 1 and 8 rows with the right kernels, and 1.5x marked a good verdict
# stale; a wrong kernel is 1.5-3x slower on top of that)
OBSERVATIONS = 5  # a contradiction holds for the fastest of this many timings of one item (a neighbour only adds)
WINDOW_S = 10.0  # ... taken within this many seconds, so that the load read over them describes each

Product = Callable[[], object]


@dataclass
class RaceResult:
    """One pass: each item's best seconds (candidate, baseline), and how busy the rest of the machine was."""

    seconds: dict[Hashable, tuple[float, float]]
    others_cores: float | None  # None where the system does not say (no /proc/stat)

    def won(self, margin: float = MARGIN) -> set[Hashable]:
        return {item for item, (candidate, baseline) in self.seconds.items() if candidate <= baseline * (1 - margin)}


def _cpu_jiffies() -> tuple[int, int] | None:
    """(every CPU's busy ticks, this process's ticks) as Linux counts them; None elsewhere."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
        with open("/proc/self/stat") as handle:
            own = handle.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait; steal counts as busy
    return sum(fields[:8]) - idle, int(own[11]) + int(own[12])  # utime + stime (fields 14, 15)


class OthersLoad:
    """Measures what other processes used of the CPUs between start and `cores()`, in cores on average."""

    def __init__(self) -> None:
        self._wall, self._ticks = time.perf_counter(), _cpu_jiffies()

    def cores(self) -> float | None:
        ticks = _cpu_jiffies()
        if ticks is None or self._ticks is None:
            return None
        hertz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        others = (ticks[0] - self._ticks[0]) - (ticks[1] - self._ticks[1])
        return max(0.0, others / hertz / max(time.perf_counter() - self._wall, 1e-3))


def _too_busy(others_cores: float | None) -> bool:
    return others_cores is not None and others_cores > BUSY_CORES


def machine_busy() -> bool:
    """Whether other processes use the CPUs now (a short look); False where the system does not say."""
    load = OthersLoad()
    time.sleep(QUIET_PROBE_S)
    return _too_busy(load.cores())


def race(items: dict[Hashable, tuple[Product, Product]], rounds: int = ROUNDS) -> RaceResult:
    """Each item's (candidate, baseline) products: one warm-up each, then `rounds` alternating runs; each
    contender's best round counts."""
    load = OthersLoad()
    best: dict[Hashable, list[float]] = {}
    for item, products in items.items():
        for product in products:
            product()
        best[item] = [float("inf"), float("inf")]
    for _ in range(rounds):
        for item, products in items.items():
            for i, product in enumerate(products):
                started = time.perf_counter()
                product()
                best[item][i] = min(best[item][i], time.perf_counter() - started)
    return RaceResult({item: (t[0], t[1]) for item, t in best.items()}, load.cores())


def stable_race(items: dict[Hashable, tuple[Product, Product]], rounds: int = ROUNDS, margin: float = MARGIN) -> dict:
    """The items the candidate wins, by `margin`, in every pass (two, or three when the first two disagree), each
    pass's seconds, and `busy` when other processes used the CPUs during any pass: the candidate then wins nothing,
    the verdict is provisional, and no more of a busy machine's time is spent on it. The margin keeps a near tie
    with the baseline, the safe default (torch's kernels); between two kernels neither of which is that, 0."""
    passes = [race(items, rounds)]
    if not _too_busy(passes[0].others_cores):
        passes.append(race(items, rounds))
        if not _too_busy(passes[1].others_cores) and passes[0].won(margin) != passes[1].won(margin):
            passes.append(race(items, rounds))
    busy = any(_too_busy(p.others_cores) for p in passes)
    won: set[Hashable] = set() if busy else set.intersection(*(p.won(margin) for p in passes))
    loads = [p.others_cores for p in passes if p.others_cores is not None]
    return {"won": sorted(won, key=str), "busy": busy, "others_cores": round(max(loads), 2) if loads else None,
            "seconds": {str(item): [[round(s, 7) for s in p.seconds[item]] for p in passes] for item in items}}


def verdicts_path() -> Path:
    from colorl.models import cache_root

    return cache_root() / "kernels.json"


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr per process for each distinct message."""
    if message not in _warned:
        _warned.add(message)
        print(f"colorl: {message}", file=sys.stderr, flush=True)


def read_verdicts(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warn_once(f"cannot read the kernel verdicts ({path}: {exc.strerror}); racing the kernels in this process")
        return {}
    try:
        verdicts = json.loads(text)
        if not isinstance(verdicts, dict):
            raise ValueError("not an object")
        return verdicts
    except ValueError:
        warn_once(f"the kernel verdicts in {path} are damaged; racing the kernels again and replacing the file")
        return {}


def _write_verdicts(path: Path, verdicts: dict) -> None:
    """Atomically, so concurrent ranks never read half a file; a cache that cannot be written is said once."""
    from colorl.files import write_atomic

    try:
        write_atomic(path, json.dumps(verdicts, indent=1))
    except OSError as exc:
        warn_once(f"cannot keep the kernel verdicts in {path} ({exc}); every process will race them again")


_lock_depth = threading.local()


@contextlib.contextmanager
def _verdicts_lock():
    """An exclusive lock on kernels.json's neighbour, held while measuring: two processes that measured at once
    would disturb each other's timings and could decide differently. Re-entrant within a thread (a race may
    need another verdict: the rows race packs weights through oneDNN's). Without a writable cache there is
    nothing to share, and no lock."""
    import fcntl

    from colorl.files import private_dir

    depth = getattr(_lock_depth, "value", 0)
    if depth:
        _lock_depth.value = depth + 1
        try:
            yield
        finally:
            _lock_depth.value = depth
        return
    path = verdicts_path().with_suffix(".lock")
    try:
        private_dir(path.parent)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _lock_depth.value = 1
        try:
            yield
        finally:
            _lock_depth.value = 0


_run_record: Path | None = None


def record_in_run(path: Path | None) -> None:
    """Keep the verdicts this process uses in the run directory too (`RUN_DIR/kernels.json`), and prefer the
    ones found there: the ranks of a run and its resume on this machine compute with the same kernels even
    when the machine's own verdicts were raced again meanwhile (bit-exact resumes stay bit-exact)."""
    global _run_record
    _run_record = None if path is None else Path(path)


def kept_verdict(name: str) -> dict | None:
    """The verdict this process would use for `name` without measuring (the run's record first), if any."""
    from colorl.machine import machine_key

    key = f"{machine_key()} {name}"
    for path in ((_run_record,) if _run_record is not None else ()) + (verdicts_path(),):
        verdict = read_verdicts(path).get(key)
        if isinstance(verdict, dict):
            return verdict
    return None


def _usable(verdict, keys: tuple[str, ...]) -> bool:
    return isinstance(verdict, dict) and all(key in verdict for key in keys)


def measured_verdict(name: str, measure: Callable[[], dict], keys: tuple[str, ...] = ()) -> dict:
    """What `measure()` found on this machine for `name` (a dict holding `keys`), measured once and kept.
    A verdict that `measure` marked `busy` (taken while other processes used the CPUs), or that a run's own
    timings contradicted (`stale`, VerdictWatch), is measured again by the first process that finds the
    machine quiet, unless the run being resumed already used it."""
    from colorl.machine import machine_key

    key = f"{machine_key()} {name}"
    run = _run_record
    if run is not None:
        verdict = read_verdicts(run).get(key)
        if _usable(verdict, keys):
            return verdict

    def needs_measuring(verdict) -> bool:
        return not _usable(verdict, keys) or ((verdict.get("busy") or verdict.get("stale")) and not machine_busy())

    with _verdicts_lock():  # the ranks of a run start together: one measures, the others wait and read
        if run is not None:
            verdict = read_verdicts(run).get(key)
            if _usable(verdict, keys):
                return verdict
        verdicts = read_verdicts(verdicts_path())
        verdict = verdicts.get(key)
        if needs_measuring(verdict):
            verdict = verdicts[key] = measure()
            verdict["measured"] = time.strftime("%Y-%m-%d %H:%M:%S")
            if verdict.get("busy"):
                warn_once("other processes were busy while colorl raced its CPU kernels: it keeps the default "
                          "kernels for now and races again when the machine is quiet (colorl doctor --kernels)")
            _write_verdicts(verdicts_path(), verdicts)
        if run is not None:
            _write_verdicts(run, {**read_verdicts(run), key: verdict})
    return verdict


def chosen_seconds(verdict: dict, item: Hashable) -> float | None:
    """The race's best seconds for the kernel `verdict` chose for `item`: the candidate where it won the item,
    else the baseline; None where the race timed no such item (a forced or older verdict)."""
    passes = verdict.get("seconds", {}).get(str(item))
    if not passes:
        return None
    chosen = 0 if str(item) in {str(won) for won in verdict.get("won", ())} else 1
    return min(seconds[chosen] for seconds in passes)


def mark_stale(name: str, verdict: dict, reason: dict) -> bool:
    """Marks the machine's verdict for `name` stale, so that the next process races it again, if it is still
    `verdict` (another process may have raced it again meanwhile). Never the run's own record: a run and its
    resume keep computing with the kernels the run chose. Whether it marked."""
    from colorl.machine import machine_key

    key = f"{machine_key()} {name}"
    with _verdicts_lock():
        verdicts = read_verdicts(verdicts_path())
        kept = verdicts.get(key)
        if not isinstance(kept, dict) or kept.get("stale") or kept.get("measured") != verdict.get("measured"):
            return False
        kept["stale"] = reason
        _write_verdicts(verdicts_path(), verdicts)
    return True


@dataclass
class _Window:
    load: OthersLoad
    started: float
    seconds: list[float]


class VerdictWatch:
    """Checks one verdict against a run's own timings of the kernels it chose, item by item. Each timing is of
    the race's work for that item (the caller scales what it timed to it). When the fastest of OBSERVATIONS
    timings of an item, taken within WINDOW_S while other processes left the CPUs quiet, is CONTRADICTION times
    what the race recorded for the chosen kernel, the machine's verdict is marked stale (`mark_stale`), once,
    with one line on stderr. A busy window, or one where the system does not say how busy it was, marks
    nothing: a neighbour's moment must not cost every later process a race."""

    def __init__(self, name: str, verdict: dict) -> None:
        self.name = name
        self.verdict = verdict  # the one this process computes with
        self.stale = False
        self._windows: dict[str, _Window] = {}
        self._raced: dict[Hashable, float | None] = {}  # chosen_seconds per item: observed every decode step

    def observe(self, item: Hashable, seconds: float) -> None:
        if item not in self._raced:
            self._raced[item] = chosen_seconds(self.verdict, item)
        raced = self._raced[item]
        if self.stale or raced is None:
            return
        now = time.perf_counter()
        window = self._windows.get(str(item))
        if window is None or now - window.started > WINDOW_S:
            window = self._windows[str(item)] = _Window(OthersLoad(), now, [])
        window.seconds.append(seconds)
        if len(window.seconds) < OBSERVATIONS:
            return
        del self._windows[str(item)]
        others = window.load.cores()
        fastest = min(window.seconds)
        if others is None or _too_busy(others) or fastest <= CONTRADICTION * raced:
            return
        self.stale = True
        reason = {"item": str(item), "observed": round(fastest, 7), "raced": round(raced, 7),
                  "others_cores": round(others, 2), "noticed": time.strftime("%Y-%m-%d %H:%M:%S")}
        if mark_stale(self.name, self.verdict, reason):
            warn_once(f"the kernel verdict '{self.name}' looks wrong: at {item} this run took {fastest / raced:.1f}x "
                      f"the time its race recorded for the kernel it chose, on a quiet machine; the next process "
                      f"races it again (this run keeps its kernels)")
