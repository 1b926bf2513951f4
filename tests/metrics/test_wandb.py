"""W&B tracking (`run.wandb`): every metric at its step and the resolved config reach the tracker, a
resume continues the same W&B run, and a failing tracker is one warning while metrics.jsonl goes on."""
from __future__ import annotations

import json
import struct
import time
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from colorl.cli import main
from colorl.config import Config, load_config
from colorl.plot import tracker_charts
from colorl.metrics.logger import METRIC_KEYS, MetricsWriter
from colorl.metrics.wandb_sink import NOT_INSTALLED, RUN_ID_FILE, WandbSink

OFFLINE = ["run.wandb={project: t, mode: offline}"]


def _record(step: int) -> dict:
    return {**{key: 0.0 for key in METRIC_KEYS}, "step": step, "loss": 0.5 / step, "reward_mean": 0.25 * step,
            "staleness_hist": {"0": 6, "1": 2}, "note": "text is not a metric"}


def _config(overrides=()) -> Config:
    return load_config("configs/tiny.yaml", [*OFFLINE, *overrides], check_paths=False)


class FakeRun:
    def __init__(self, fails_on: str | None) -> None:
        self.logged: list[dict] = []
        self.finished = False
        self._fails_on = fails_on

    def define_metric(self, name, **kwargs) -> None:
        pass

    def log(self, data: dict) -> None:
        if self._fails_on == "log":
            raise RuntimeError("tracker down")
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


class FakeWandb:
    """Records what the sink asks of wandb; `fails_on` makes `init` or `log` raise."""

    def __init__(self, fails_on: str | None = None) -> None:
        self.inits: list[dict] = []
        self.run = FakeRun(fails_on)
        self._fails_on = fails_on

    def init(self, **kwargs) -> FakeRun:
        if self._fails_on == "init":
            raise ConnectionError("no network\nsecond line")
        self.inits.append(kwargs)
        return self.run

    @staticmethod
    def Image(path: str):
        return SimpleNamespace(png=Path(path).read_bytes())


def _fake_sink(cfg, run_dir: Path, wandb: FakeWandb) -> WandbSink:
    return WandbSink(cfg.run.wandb, cfg.run.name, run_dir, cfg.model_dump(mode="json"), wandb=wandb)


def test_every_metric_at_its_step_the_config_and_the_charts(tmp_path):
    cfg = _config(["run.name=r1"])
    wandb = FakeWandb()
    writer = MetricsWriter(tmp_path, wandb=_fake_sink(cfg, tmp_path, wandb))
    for step in (1, 2):
        writer.write(_record(step))
    writer.close(lambda folder: tracker_charts(tmp_path, folder))  # what a run's end hands the trackers
    (init,) = wandb.inits
    assert init["config"] == cfg.model_dump(mode="json")
    assert (init["project"], init["name"], init["mode"], init["resume"]) == ("t", "r1", "offline", "allow")
    assert init["dir"] == str(tmp_path)
    steps, charts = wandb.run.logged[:2], wandb.run.logged[2]
    for step, logged in zip((1, 2), steps):
        numbers = {k: v for k, v in _record(step).items() if isinstance(v, float | int)}
        assert logged == {**numbers, "staleness_hist/0": 6, "staleness_hist/1": 2}
    assert {"charts/reward", "charts/length", "charts/time", "charts/policy"} <= set(charts)
    assert all(image.png.startswith(b"\x89PNG") for image in charts.values())
    assert wandb.run.finished


def test_a_resumed_run_directory_keeps_its_run_id(tmp_path):
    cfg = _config()
    first, second = FakeWandb(), FakeWandb()
    _fake_sink(cfg, tmp_path, first).finish()
    _fake_sink(cfg, tmp_path, second).finish()  # `colorl train ... --resume`
    assert first.inits[0]["id"] == second.inits[0]["id"] == (tmp_path / RUN_ID_FILE).read_text().strip()
    other = FakeWandb()
    _fake_sink(cfg, tmp_path / "another-run", other)
    assert other.inits[0]["id"] != first.inits[0]["id"]


@pytest.mark.parametrize("fails_on", ["init", "log"])
def test_a_failing_tracker_is_one_warning_and_the_metrics_go_on(tmp_path, capsys, fails_on):
    cfg = _config()
    writer = MetricsWriter(tmp_path, wandb=_fake_sink(cfg, tmp_path, FakeWandb(fails_on)))
    for step in (1, 2, 3):
        writer.write(_record(step))
    writer.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colorl: warning: run.wandb:"), lines
    assert ("no network" in lines[0]) if fails_on == "init" else ("tracker down" in lines[0])
    written = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written == [1, 2, 3]


def test_wandb_not_installed_is_one_warning(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    writer = MetricsWriter.for_run(tmp_path, _config())
    writer.write(_record(1))
    writer.close()
    assert capsys.readouterr().err.strip() == f"colorl: warning: run.wandb: {NOT_INSTALLED}"
    assert (tmp_path / "metrics.jsonl").exists()


def test_unset_or_disabled_tracks_nothing(tmp_path):
    assert WandbSink.for_run(load_config("configs/tiny.yaml", check_paths=False), tmp_path) is None
    assert WandbSink.for_run(_config(["run.wandb.mode=disabled"]), tmp_path) is None
    assert not (tmp_path / "wandb").exists()


def test_config_accepts_a_wandb_section_and_rejects_an_unknown_mode(capsys):
    cfg = load_config("configs/tiny.yaml", ["run.wandb={project: p, mode: offline}"], check_paths=False)
    assert (cfg.run.wandb.project, cfg.run.wandb.name, cfg.run.wandb.mode) == ("p", None, "offline")
    code = main(["train", "configs/tiny.yaml", "--dry-run", "--set", "run.wandb={mode: cloudy}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert all(word in err[0] for word in ("run.wandb.mode", "cloudy", "offline"))


# ---------------------------------------------------------------- the real wandb, offline

def _offline_records(run_dir: Path, wait_s: float = 60.0) -> list:
    """The records of the run's offline .wandb file, once it holds the run's `exit` record: wandb's service
    process writes the file and may still be flushing it when `finish()` returns (seen on a busy machine:
    a file without its records yet)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = _read_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _read_records(run_dir: Path) -> list:
    """A LevelDB-style log (7-byte header, 32 KiB blocks of chunks, each with a 7-byte crc/length/type
    header) of wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    (file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, chunks, records = file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_real_offline_run_holds_the_metrics_and_the_config(tmp_path):
    pytest.importorskip("wandb")
    cfg = _config(["run.seed=7"])
    writer = MetricsWriter.for_run(tmp_path, cfg)
    for step in (1, 2):
        writer.write(_record(step))
    writer.close(lambda folder: tracker_charts(tmp_path, folder))
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    records = _offline_records(tmp_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "t", "tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["run"]["seed"] == 7 and config["model"] == cfg.model_dump(mode="json")["model"]
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    steps = [h for h in history if "loss" in h]
    assert [(h["step"], h["loss"], h["staleness_hist/1"]) for h in steps] == [(1, 0.5, 2), (2, 0.25, 2)]
    assert any(key.startswith("charts/reward") for h in history for key in h)
    assert list((tmp_path / "wandb").glob("offline-run-*/files/media/images/charts/reward_*.png"))


def test_train_with_offline_wandb_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "helpers"))
    run_dir = tmp_path / "run"
    argv = ["train", "configs/tiny.yaml", "--run-dir", str(run_dir)]
    for item in ["run.steps=1", "rollout.max_new_tokens=8", *OFFLINE]:
        argv += ["--set", item]
    assert main(argv) == 0
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    first_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert main(argv[:2] + ["--resume", *argv[2:]] + ["--set", "run.steps=2"]) == 0
    assert (run_dir / RUN_ID_FILE).read_text().strip() == first_id
    runs = {path.name.rsplit("-", 1)[-1] for path in (run_dir / "wandb").glob("offline-run-*")}
    assert runs == {first_id}
