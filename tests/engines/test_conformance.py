"""One conformance matrix over every engine: the same interface, and whole runs of both modes.

The engine list is `COLUMNS`, the one place to add an engine: each column gets the signature check
against colorl/engines/base.py's `Engine` and four whole runs through the real launcher on the
tiny model, each with the checkpoint engine's bit-exact check after every sync and applied version
(colorl/sync/verify.py, as `colorl doctor` runs it; a difference fails the run):

    colocated    sleep level 2, LoRA, eval after every step, zero-variance filter; resumed from
                 step 2 it trains step 3 exactly as the uninterrupted run did
    colocated    sleep level 1, full weights served in bf16 from fp32 master weights, eval, zero-variance filter
    bounded-lag  LoRA, eval, zero-variance filter with batch-level redundancy at G/world = 1 (one
                 surplus entry, η = 1); staleness within η, no prompt trained twice, and resumed
                 from step 2 no prompt handed out before the save is lost
    bounded-lag  multi-turn episodes with a scripted tool environment, η = 1
    bounded-lag  the same at two ranks, on CPU as on a two-GPU box under the device-placement
                 recorder: rank r's trainer, engine and threads touch only cuda:r
    both modes   multi-turn episodes under each chat template of tests/helpers/chat_templates.py
                 (ChatML, trimming ChatML, Llama 3, SmolLM2, a BOS per turn), tool messages included

The SGLang column is colorl's real adapter over the CPU stand-in of the package
(tests/engines/sglang_standin.py), installed in each rank by tests/helpers/standin_rank.py. The
vllm-standin column is colorl's real vLLM adapter over the stand-in of vLLM's CUDA build
(tests/engines/vllm_standin.py: sleep levels, the executor's device per rank, async scheduling),
every run of it as on a GPU box under the device-placement recorder, so the adapter takes its
CUDA branch; the vllm column is the real CPU build, its CPU branch.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import shutil
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import pytest
import torch

from colorl.doctor import CPU_MODELS
from colorl.engines import engine_class
from colorl.engines.base import Engine
from chat_templates import TEMPLATES  # tests/helpers
from checked_runs import checked_run as run_checked, metrics, weights  # tests/helpers


def _checked_rank() -> Callable:
    from colorl.doctor import checked_rank

    return checked_rank


def _standin_rank() -> Callable:
    from standin_rank import sglang_standin_rank  # tests/helpers: installs the stand-in in the rank

    return sglang_standin_rank


def _vllm_standin_rank() -> Callable:
    from device_recorder import on_own_gpu  # tests/helpers
    from standin_rank import vllm_standin_rank

    return functools.partial(on_own_gpu, vllm_standin_rank)


def _vllm_wheel_missing() -> str | None:
    """The stand-in picks each engine's device with the wheel's own executor code (tests/helpers/vllm_wheel.py)."""
    import vllm_wheel

    return vllm_wheel.missing()


def _install_vllm_standin(monkeypatch) -> None:
    """In the test process too: the config's validation looks for the vllm package."""
    from standin_rank import load_standin

    load_standin("vllm_standin").install(monkeypatch)


def _sglang_wheel_missing() -> str | None:
    """The stand-in runs the wheel's own serialisation code (tests/helpers/sglang_wheel.py)."""
    import sglang_wheel

    try:
        sglang_wheel.obtain()
    except sglang_wheel.WheelUnavailable as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Column:
    name: str
    engine: str  # rollout.engine (its class comes from colorl.engines' registry)
    rank: Callable[[], Callable] = _checked_rank  # gives the function each rank runs
    needs: str | None = None  # a package the engine needs here; skipped when it is not importable
    missing: Callable[[], str | None] = lambda: None  # anything else it needs: why it cannot run, or None
    sets: tuple[str, ...] = ()  # settings the engine needs (a model it accepts)
    on_gpu: bool = False  # its ranks already run as on a GPU box (under the device-placement recorder)
    install: Callable | None = None  # given pytest's monkeypatch: what the test process needs (a stand-in)

    def skip_reason(self) -> str | None:
        if self.needs and importlib.util.find_spec(self.needs) is None:
            return f"{self.needs} is not importable here (it runs in its own venv, .venv-{self.needs})"
        return self.missing()



COLUMNS = [
    Column("native", "native"),
    Column("hf", "hf"),
    Column("sglang-standin", "sglang", rank=_standin_rank, missing=_sglang_wheel_missing),
    Column("vllm", "vllm", needs="vllm", sets=(f"model.path={CPU_MODELS['vllm']}",)),
    Column("vllm-standin", "vllm", rank=_vllm_standin_rank, missing=_vllm_wheel_missing, on_gpu=True,
           install=_install_vllm_standin),
]
BASE = ["task.reward=reward_fns:long_is_right", "rollout.max_new_tokens=8", "run.eval_every=1", "run.eval_prompts=4",
        "filter.zero_variance=true", "train.lr=1e-2", "launch.device=auto", "launch.nproc=1"]
LORA = "model.lora={r: 4, alpha: 8}"
RESUMABLE = ["run.steps=3", "run.save_every=2", "run.optimizer_state=all"]  # step_2 keeps what a resume needs


@pytest.fixture(params=COLUMNS, ids=[c.name for c in COLUMNS])
def column(request, monkeypatch) -> Column:
    return _ready(request.param, monkeypatch)


def _ready(column: Column, monkeypatch) -> Column:
    """The column, skipped where it cannot run, with what the test process needs installed."""
    reason = column.skip_reason()
    if reason:
        pytest.skip(reason)
    if column.install:
        column.install(monkeypatch)
    return column


# -- the interface -----------------------------------------------------------------------------------

INTERFACE = sorted(name for name, member in vars(Engine).items() if callable(member) and not name.startswith("_"))


def parameters(function) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_every_engine_has_the_interfaces_signatures(column):
    cls = engine_class(column.engine)
    assert issubclass(cls, Engine)
    differing = {name: (parameters(getattr(cls, name)), parameters(getattr(Engine, name))) for name in INTERFACE
                 if parameters(getattr(cls, name)) != parameters(getattr(Engine, name))}
    assert differing == {}, f"{column.name}: (engine's, Engine's) parameters differ"
    assert isinstance(inspect.getattr_static(cls, "version"), (int, property))
    assert isinstance(cls.keeps_kv_across_updates, bool)


# -- whole runs --------------------------------------------------------------------------------------

def checked_run(column: Column, sets: list[str], run_dir: Path, resume: bool = False,
                rank: Callable | None = None) -> list[dict]:
    """A run of this column's engine with the sync check on (a weight mismatch fails it);
    `rank`: the function each rank runs, if not the column's."""
    return run_checked(rank or column.rank(), [*BASE, f"rollout.engine={column.engine}", *column.sets, *sets],
                       run_dir, resume, column.name)


def interrupted_copy(run_dir: Path, into: Path, step: int) -> Path:
    """The run directory as a run killed after step `step`'s checkpoint would have left it."""
    shutil.copytree(run_dir, into, ignore=lambda folder, names: [n for n in names if n.startswith("step_")
                                                                   and n != f"step_{step}"])
    kept = [line for line in (into / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= step]
    (into / "metrics.jsonl").write_text("".join(f"{line}\n" for line in kept))
    return into


def assert_common(lines: list[dict], steps: int, eta: int) -> None:
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in lines)
    assert all(r["staleness_max"] <= eta for r in lines), [r["staleness_max"] for r in lines]
    assert all(r["eval_accuracy"] is not None for r in lines)  # eval after every step
    trained = [i for r in lines for i in r["trained_problems"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice


@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_colocated_sleep2_lora_eval_zero_variance_and_exact_resume(column, tmp_path):
    sets = [*RESUMABLE, LORA, "engine.sleep_level=2", "mode=colocated"]
    straight = tmp_path / "straight"
    (report,) = checked_run(column, sets, straight)
    assert report["checked_versions"] == [0, 1, 2, 3]  # start-up, then after each step: bit-exact
    lines = metrics(straight)
    assert_common(lines, 3, eta=0)
    # the filter had work (a group without reward variance, masked out) and the weights something to learn
    assert min(r["groups_mixed_frac"] for r in lines) < 1 and max(r["groups_mixed_frac"] for r in lines) > 0
    resumed = interrupted_copy(straight, tmp_path / "resumed", step=2)
    (again,) = checked_run(column, sets, resumed, resume=True)
    assert again["checked_versions"] == [2, 3]
    keys = ("step", "version", "loss", "reward_mean", "response_len_mean", "grad_norm", "trained_problems",
            "groups_mixed_frac")
    assert [{k: r[k] for k in keys} for r in metrics(resumed)] == [{k: r[k] for k in keys} for r in lines]
    a, b = weights(straight, 3), weights(resumed, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_colocated_sleep1_full_weights_eval_zero_variance_bf16_serving(column, tmp_path):
    """The GPU dtype contract: fp32 master weights, the engine serving bf16 (cast once per sync)."""
    (report,) = checked_run(column, ["run.steps=2", "engine.sleep_level=1", "mode=colocated", "engine.dtype=bfloat16"],
                            tmp_path / "run")
    assert report["checked_versions"] == [0, 1, 2]
    assert_common(metrics(tmp_path / "run"), 2, eta=0)


@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_bounded_lag_lora_eval_zero_variance_batch_redundancy_and_resume(column, tmp_path):
    keep = engine_class(column.engine).keeps_kv_across_updates
    sets = [*RESUMABLE, LORA, "mode=bounded_lag", "staleness.max=1", "rollout.batch_groups=1",
            "staleness.redundancy={level: batch, ratio: 1.0}", f"staleness.partial_rollout={'keep' if keep else 'recompute'}"]
    run = tmp_path / "run"
    (report,) = checked_run(column, sets, run)
    checked = report["checked_versions"]
    assert checked[0] == 0 and checked == sorted(set(checked)) and len(checked) >= 2  # published versions applied
    assert_common(metrics(run), 3, eta=1)
    resumed = interrupted_copy(run, tmp_path / "resumed", step=2)
    (again,) = checked_run(column, sets, resumed, resume=True)
    assert again["checked_versions"][0] == 2
    lines = metrics(resumed)
    assert_common(lines, 3, eta=1)
    assert sum(r["groups_filtered"] for r in lines) > 0  # zero-variance groups released from the buffer
    saved = json.loads((resumed / "checkpoints" / "step_2" / "rollout_rank0.json").read_text())
    # G/world = 1 at world size 1: ticket t is problem t. The resumed run trains what the save held
    # (completed groups, tickets in flight) or tickets it had not handed out yet: its data position
    held = {*saved["reissue"], *(c["group"]["ticket"] for c in saved["completed"])}
    assert all(t in held or t >= saved["next_ticket"] for t in lines[2]["trained_problems"]), (saved, lines[2])


@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_two_ranks_each_on_its_own_gpu(column, tmp_path):
    """The CUDA branches of a two-rank bounded-lag run with episodes and eval, on CPU under the
    device-placement recorder (tests/helpers/device_recorder.py): the trainer, the engine, the
    rollout thread and the environment pool's threads of rank r name only cuda:r (never a bare
    "cuda"), and every thread that uses the current device has made cuda:r current first."""
    from device_recorder import on_own_gpu

    if column.name == "vllm":  # vLLM's CPU build refuses the CUDA branch's options (enable_sleep_mode)
        pytest.skip("the CUDA branch of the vLLM adapter runs in the vllm-standin column")
    keep = engine_class(column.engine).keeps_kv_across_updates
    sets = ["run.steps=2", "launch.nproc=2", "mode=bounded_lag", "staleness.max=1", "rollout.batch_groups=2",
            f"staleness.partial_rollout={'keep' if keep else 'recompute'}", "task.reward=null",
            "task.env=scripted_envs:DeviceToolEnv", "task.max_turns=4", "filter.zero_variance=false"]
    rank = column.rank() if column.on_gpu else functools.partial(on_own_gpu, column.rank())
    ranks = checked_run(column, sets, tmp_path / "run", rank=rank)
    assert [r["steps"] for r in ranks] == [2, 2] and all(r["checked_versions"][0] == 0 for r in ranks)
    lines = metrics(tmp_path / "run")
    assert_common(lines, 2, eta=1)
    assert all(r["env_errors"] == 0 for r in lines)  # the tool's device call found cuda:r current in its thread


@pytest.mark.matrix
@pytest.mark.timeout(300)
def test_bounded_lag_multi_turn_episodes(column, tmp_path):
    """Episodes with a scripted tool environment (tests/helpers/scripted_envs.py): each engine serves every
    turn with the whole conversation as its prompt, across weight versions, within η."""
    keep = engine_class(column.engine).keeps_kv_across_updates
    sets = ["run.steps=2", "mode=bounded_lag", "staleness.max=1", f"staleness.partial_rollout={'keep' if keep else 'recompute'}",
            "task.reward=null", "task.env=scripted_envs:ShortScriptedEnv", "task.max_turns=4", "filter.zero_variance=false"]
    (report,) = checked_run(column, sets, tmp_path / "run")
    assert report["checked_versions"][0] == 0
    lines = metrics(tmp_path / "run")
    assert_common(lines, 2, eta=1)
    assert all(r["episode_turns_mean"] == 3 and r["env_errors"] == 0 and r["episodes_truncated"] == 0 for r in lines)
    assert all(r["episode_len_mean"] > r["response_len_mean"] > 0 for r in lines)  # tool results: context only


def _template_cases() -> list:
    """Every template in both modes, each (template, mode) on one column, turning through the columns so
    that each column meets both modes and several templates: every column times every case is 40 whole
    runs (30-45 min on 2 cores), and tests/envs runs the whole template matrix on the native engine."""
    modes = ["colocated", "bounded_lag"]
    return [pytest.param(COLUMNS[(t + m) % len(COLUMNS)], template, mode,
                         id=f"{COLUMNS[(t + m) % len(COLUMNS)].name}-{template}-{mode}")
            for t, template in enumerate(TEMPLATES) for m, mode in enumerate(modes)]


@pytest.mark.matrix
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine_column", "template", "mode"), _template_cases())
def test_multi_turn_episodes_under_each_chat_template(engine_column, template, mode, tmp_path, monkeypatch):
    """Issue 33 item 3: templates that trim each message, put a BOS or a header before every turn, add a
    default system turn, or render the environment's tool messages their own way; every turn's prompt is
    the conversation so far, extended by the engine's tokens, in both modes."""
    from chat_templates import save_template_model  # tests/helpers

    column = _ready(engine_column, monkeypatch)
    keep = engine_class(column.engine).keeps_kv_across_updates
    model = save_template_model(tmp_path / "model", template)
    sets = ["run.steps=2", f"mode={mode}", "staleness.max=1", f"staleness.partial_rollout={'keep' if keep else 'recompute'}",
            "task.reward=null", "task.env=scripted_envs:ShortScriptedEnv", "task.max_turns=4", "filter.zero_variance=false",
            "rollout.batch_groups=2", f"model.path={model}"]
    (report,) = checked_run(column, sets, tmp_path / "run")
    assert report["checked_versions"][:2] == [0, 1]
    lines = metrics(tmp_path / "run")
    assert_common(lines, 2, eta=0 if mode == "colocated" else 1)
    episodes = [{k: r[k] for k in ("episode_turns_mean", "env_errors", "episodes_truncated")} for r in lines]
    assert all(e == {"episode_turns_mean": 3, "env_errors": 0, "episodes_truncated": 0} for e in episodes), episodes
    assert all(r["episode_len_mean"] > r["response_len_mean"] > 0 for r in lines)  # tool results: context only
