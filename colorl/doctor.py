"""`colorl doctor [CONFIG]`: the first command on a new box. Does every mode, sleep level and LoRA
setting run here, with the engine serving exactly the trainer's weights after every sync?

Each case is a two-step run through the real launcher, ranks and mode loop, with the checkpoint
engine's bit-exact check on (colorl/sync/verify.py: after every sync, and every published
version the engine applies, its weights must equal the trainer's bit for bit). Cases: for each
engine, colocated × `engine.sleep_level` 1, 2 × LoRA off, on, and bounded-lag × LoRA off, on
(bounded-lag never sleeps its engine). A held-out eval runs after every step, so the wake/sleep
around it is exercised too.

With CUDA, CONFIG's model, dtype and engine are checked on every GPU (one rank each, `--nproc` to
change), with two more cases per engine: bf16 mixed precision with the optimizer offloaded, and
LoRA on a bf16 base (configs/gpu-smoke.yaml is a small model). Without CUDA the same cases run with the CPU engines (native, hf) on the tiny random
model, in a few minutes. Memory is sampled at each phase switch of the trainer's loop: torch's
allocated / peak / reserved bytes on CUDA, the device memory held outside this process's
allocator (the SGLang scheduler process, CUDA contexts), and the resident memory of the rank
and of its child processes. One verdict line per case; a JSON report to attach to a bug report.
Exit 0 when every case passes, 1 when one fails, 2 on bad input.
"""
from __future__ import annotations

import fnmatch
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from colorl.exits import EXIT_BAD_INPUT, EXIT_RUN_FAILED, fail, installed_version
from colorl.heap import resident_bytes
from colorl.machine import resolve_device

STEPS = 2
CPU_ENGINES = ("native", "hf")
CPU_SETTINGS = ["model.path=tiny-random-llama", "model.dtype=float32", "task.name=arithmetic",
                "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.concurrency=16",
                "engine.max_num_seqs=16", "train.lr=1e-3", "run.eval_prompts=4"]
# the tiny model an engine accepts on CPU, where it is not CPU_SETTINGS' (vLLM's CPU attention refuses head_dim 16)
CPU_MODELS = {"vllm": "tiny-random-llama-hd32"}
LORA = "{r: 8, alpha: 16}"
GIB = 2**30


def graded_reward(prompt: str, completion: str, answer: str) -> float:
    """An arbitrary but deterministic grade of the completion's text in [0, 1]: different texts get
    different rewards, so groups have reward variance and every step moves the weights (a sync of
    unchanged weights would prove nothing). The doctor checks the machinery, not learning."""
    return sum(map(ord, completion)) % 101 / 100


@dataclass(frozen=True)
class Case:
    engine: str
    mode: str  # "colocated" | "bounded_lag"
    sleep_level: int | None  # None in bounded-lag: its engine never sleeps
    lora: bool
    variant: str = ""  # a GPU_VARIANTS key: settings a GPU run takes on top

    @property
    def name(self) -> str:
        sleep = f"/sleep{self.sleep_level}" if self.sleep_level else ""
        variant = f"-{self.variant}" if self.variant else ""
        return f"{self.engine}/{self.mode}{sleep}/{'lora' if self.lora else 'full'}{variant}"

    def settings(self, lora: str, keeps_kv: bool) -> list[str]:
        """Config overrides of this case (`lora`: the adapter settings when it is on)."""
        sets = [f"rollout.engine={self.engine}", f"mode={self.mode}", f"model.lora={lora if self.lora else 'null'}",
                *GPU_VARIANTS.get(self.variant, ())]
        if self.sleep_level:
            sets.append(f"engine.sleep_level={self.sleep_level}")
        else:  # an engine that cannot keep its KV across an update re-prefills in-flight samples
            sets += ["staleness.max=1", f"staleness.partial_rollout={'keep' if keeps_kv else 'recompute'}"]
        return sets


# what a GPU run uses that the matrix's cases leave at the config's values: bf16 mixed precision over
# float32 master weights with the optimizer state offloaded between steps, and LoRA on a bf16 base
GPU_VARIANTS = {"bf16-offload": ("train.mixed_precision=bfloat16", "train.offload_optimizer=true"),
                "bf16-base": ("model.dtype=bfloat16", "engine.dtype=bfloat16"),
                "qwen2": ("model.path=tiny-random-qwen2",)}
# engines whose weight check reads some model families another way, with the variant that covers it:
# SGLang reads the Llama family back row by row, Qwen2 (attention biases) only through its checksums
FAMILY_VARIANTS = {"sglang": "qwen2"}


def cases_for(engines, gpu: bool = False) -> list[Case]:
    """Every mode x sleep level x LoRA setting per engine; on a GPU also the GPU_VARIANTS (and an
    engine's FAMILY_VARIANTS)."""
    matrix = [Case(e, "colocated", level, lora) for e in engines for level in (1, 2) for lora in (False, True)] + \
             [Case(e, "bounded_lag", None, lora) for e in engines for lora in (False, True)]
    variants = [Case(e, "colocated", 1, False, "bf16-offload") for e in engines] + \
               [Case(e, "colocated", 1, True, "bf16-base") for e in engines] + \
               [Case(e, "colocated", 1, False, FAMILY_VARIANTS[e]) for e in engines if e in FAMILY_VARIANTS]
    return matrix + (variants if gpu else [])


# -- inside each rank ------------------------------------------------------------------------------

@dataclass
class MemoryProbe:
    """Memory at the end of each phase of the trainer's loop, on this rank."""

    device: str
    rows: list[dict] = field(default_factory=list)

    def record(self, phase: str) -> None:
        row = {"phase": phase, "rss": resident_bytes(),
               "children_rss": sum(resident_bytes(p) or 0 for p in _children())}
        if self.device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            row.update(allocated=torch.cuda.memory_allocated(self.device), reserved=reserved,
                       peak_allocated=torch.cuda.max_memory_allocated(self.device),
                       outside_allocator=total - free - reserved)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.rows.append(row)


def _children() -> list[int]:
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def checked_rank(rank: int, world: int, cfg_dict: dict, run_dir: str, resume: bool, device: str,
                 report_dir: str) -> None:
    """One rank of a checked run: the real context and mode loop with the sync check on; writes
    REPORT_DIR/rank{R}.json (versions checked, steps done, memory per phase)."""
    from colorl.config import validate
    from colorl.metrics.display import Display
    from colorl.modes import MODES
    from colorl.worker import StopRequest, build_context

    cfg = validate(cfg_dict)
    stop = StopRequest()
    ctx = build_context(cfg, rank, world, device, Path(run_dir), resume)
    verifier = ctx.weight_sync.enable_verification()
    ctx.display = Display(cfg.run.steps, ctx.state.step, cfg.run.name, enabled=False)  # the doctor prints verdicts
    probe, current = MemoryProbe(ctx.device), ["start"]

    def phase(name: str) -> None:  # the display hears of every phase switch: sample memory there
        probe.record(current[0])
        current[0] = name

    ctx.display.phase = phase
    try:
        MODES[cfg.mode](ctx, stop)
        probe.record(current[0])
    finally:
        ctx.close()
    Path(report_dir, f"rank{rank}.json").write_text(json.dumps({
        "checked_versions": verifier.checked, "unread": sorted(verifier.unread), "steps": ctx.state.step,
        "engine_version": ctx.engine.version,
        "memory": probe.rows}))


# -- the command -----------------------------------------------------------------------------------

@dataclass
class Outcome:
    case: str
    passed: bool
    detail: str
    seconds: float
    settings: list[str]
    ranks: list[dict] = field(default_factory=list)


def verdict(case: Case, ranks: list[dict], steps: int) -> tuple[bool, str]:
    """Whether every rank ran the steps and checked what the mode syncs: colocated every version
    0..steps; bounded-lag the start-up version and at least one published version it applied."""
    for rank, report in enumerate(ranks):
        checked = report["checked_versions"]
        if report["steps"] != steps:
            return False, f"rank {rank} stopped after {report['steps']} of {steps} steps"
        if case.mode == "colocated" and checked != list(range(steps + 1)):
            return False, f"rank {rank} checked versions {checked}, expected {list(range(steps + 1))}"
        if case.mode == "bounded_lag" and (checked[:1] != [0] or checked != sorted(set(checked)) or len(checked) < 2):
            return False, f"rank {rank} checked versions {checked}: the engine applied no published version"
    versions = ranks[0]["checked_versions"] if ranks else []
    unread = sorted({name for report in ranks for name in report.get("unread", ())})
    detail = f"{steps} steps, weights bit-exact after {len(versions)} syncs (versions {versions})"
    if unread:  # passed on what the engine could read back; the rest is named, not passed silently
        detail += f"; {len(unread)} engine weights not read back, not checked (first: {unread[0]})"
    return True, detail


def run_case(plan: "DoctorPlan", case: Case, out: Path) -> Outcome:
    """A two-step checked run of `case` through the launcher; its verdict."""
    from colorl.launch import launch
    from colorl.worker import prepare_run_dir

    started = time.perf_counter()
    settings, cfg = plan.case_config(case)
    run_dir = out / case.name.replace("/", "-")
    report_dir = run_dir / "doctor"
    prepare_run_dir(cfg, run_dir, resume=False)
    report_dir.mkdir()
    failure = launch(checked_rank, plan.nproc, plan.device, (cfg.model_dump(mode="json"), str(run_dir), False,
                                                              plan.device, str(report_dir)), cfg.launch.collective_timeout_s)
    seconds = time.perf_counter() - started
    if failure is not None:
        head = failure.error.strip().splitlines()[0] if failure.error.strip() else "no report"
        return Outcome(case.name, False, f"rank {failure.rank}: {head}", seconds, settings)
    ranks = [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(plan.nproc)]
    passed, detail = verdict(case, ranks, cfg.run.steps)
    return Outcome(case.name, passed, detail, seconds, settings, ranks)


def memory_lines(outcome: Outcome, device: str) -> list[str]:
    """Per phase, the largest value over steps and ranks."""
    worst: dict[str, dict] = {}
    for report in outcome.ranks:
        for row in report["memory"]:
            into = worst.setdefault(row["phase"], {})
            for key, value in row.items():
                if key != "phase" and value is not None:
                    into[key] = max(into.get(key, 0), value)
    keys = ([("allocated", "allocated"), ("peak_allocated", "peak"), ("reserved", "reserved"),
             ("outside_allocator", "engine process + contexts")] if device == "cuda" else [])
    keys += [("rss", "RSS"), ("children_rss", "child processes RSS")]
    return [f"    after {phase:<8} " + " · ".join(f"{label} {row[k] / GIB:.2f} GiB" for k, label in keys if k in row)
            for phase, row in worst.items() if phase != "start"]


def machine() -> dict:
    import torch

    info = {"colorl": installed_version(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    gpus=torch.cuda.device_count(), cuda_version=torch.version.cuda)
    return info


@dataclass
class DoctorPlan:
    """What `colorl doctor` runs: the cases, and the settings every case starts from."""

    cases: list[Case]
    config: str | None  # the config file the cases start from (None: the CPU cases' own settings)
    base: list[str]  # overrides applied to it, then each case's own
    lora: str  # the adapter settings of the LoRA cases
    device: str
    nproc: int
    notes: list[str]

    def case_config(self, case: Case):
        """(all overrides, validated Config) of one case."""
        from colorl.config import load_config
        from colorl.engines import engine_class

        settings = [*self.base, *case.settings(self.lora, engine_class(case.engine).keeps_kv_across_updates),
                    f"launch.nproc={self.nproc}"]
        if self.device == "cpu" and case.engine in CPU_MODELS:
            settings.append(f"model.path={CPU_MODELS[case.engine]}")
        return settings, load_config(self.config, settings)


def cpu_engines() -> list[str]:
    """The engines that run without CUDA here: native, hf, and vllm where its CPU build is installed."""
    import importlib.util

    from colorl.engines import ENGINES

    return [*CPU_ENGINES, *(e for e in ("vllm",) if e in ENGINES and importlib.util.find_spec(e) is not None)]


def plan_cases(args) -> DoctorPlan:
    """The doctor's plan from the command line; ValueError (one line) on bad input."""
    import torch

    from colorl.config import load_config
    from colorl.preflight import check_devices

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: give at least 1 rank")
    cfg = load_config(args.config, list(args.set or [])) if args.config else None
    device = resolve_device(args.device)
    notes, user = [], list(args.set or [])
    common = [f"run.steps={STEPS}", "run.save_every=0", "run.eval_every=1", "task.reward=colorl.doctor:graded_reward",
              f"launch.device={device}"]
    if device == "cuda":
        nproc = args.nproc or torch.cuda.device_count()  # every GPU: NCCL over all of them, an engine on each
        check_devices("cuda", nproc, cfg.rollout.engine if cfg else "native")
        if cfg is None:
            raise ValueError("colorl doctor on a GPU checks a config's model: give one, e.g. configs/gpu-smoke.yaml")
        base, engines, config = [*user, *common], [cfg.rollout.engine], args.config
        lora = _flow(cfg.model.lora.model_dump(mode="json")) if cfg.model.lora else LORA
    else:
        check_devices("cpu", 1)
        if cfg is not None:
            notes.append(f"no CUDA here: {args.config}'s model ({cfg.model.path}) is checked on a GPU; "
                         f"these are the same cases with the CPU engines on the tiny model")
        nproc, base, engines, lora, config = args.nproc or 2, [*CPU_SETTINGS, *user, *common], cpu_engines(), LORA, None
    base.append(f"rollout.batch_groups={nproc}")
    every = cases_for(engines, gpu=device == "cuda")
    cases = [c for c in every if not args.case or any(fnmatch.fnmatch(c.name, p) for p in args.case)]
    if not cases:
        raise ValueError(f"--case {' '.join(args.case)}: no case matches; cases: {', '.join(c.name for c in every)}")
    return DoctorPlan(cases, config, base, lora, device, nproc, notes)


def _flow(mapping: dict) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in mapping.items()) + "}"


def kernel_thread_counts() -> tuple[int, ...]:
    """The thread counts a CPU run uses here: one (a rank of many, a bounded-lag loop) and every core."""
    return tuple(sorted({1, os.cpu_count() or 1}))


def cmd_kernels() -> int:
    from colorl.engines.native.kernel_report import kernel_lines

    for line in kernel_lines(kernel_thread_counts()):
        print(line, flush=True)
    return 0


def cmd_doctor(args) -> int:
    from colorl.config import ConfigError
    from colorl.preflight import preflight

    if args.kernels:
        return cmd_kernels()
    try:
        plan = plan_cases(args)
        for note in plan.notes + preflight(plan.case_config(plan.cases[0])[1], plan.device):
            print(f"colorl doctor: {note}", flush=True)
    except (ConfigError, ValueError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    out = Path(args.out) if args.out else Path("runs") / f"doctor-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()):
        return fail(f"--out {out}: not empty; choose another folder", EXIT_BAD_INPUT)
    out.mkdir(parents=True, exist_ok=True)
    print(f"colorl doctor: {len(plan.cases)} cases, {STEPS} steps each, {plan.nproc} x {plan.device}; "
          f"report: {out / 'doctor.json'}", flush=True)
    kernels = []
    if plan.device == "cpu":
        from colorl.engines.native.kernel_report import kernel_lines

        kernels = kernel_lines(kernel_thread_counts())
        for line in kernels:
            print(f"colorl doctor: kernels: {line}", flush=True)
    outcomes = []
    for case in plan.cases:
        try:
            outcome = run_case(plan, case, out)
        except (ConfigError, ValueError, OSError) as exc:
            outcome = Outcome(case.name, False, str(exc).splitlines()[0], 0.0, [])
        outcomes.append(outcome)
        print(f"{'PASS' if outcome.passed else 'FAIL'}  {case.name:<34} {outcome.detail} ({outcome.seconds:.0f} s)",
              flush=True)
        for line in memory_lines(outcome, plan.device):
            print(line, flush=True)
    (out / "doctor.json").write_text(json.dumps(
        {"machine": machine(), "kernels": kernels, "device": plan.device, "nproc": plan.nproc, "config": args.config,
         "cases": [asdict(o) for o in outcomes]}, indent=1))
    failed = [o.case for o in outcomes if not o.passed]
    print(f"colorl doctor: {len(outcomes) - len(failed)} of {len(outcomes)} cases pass"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; report: {out / 'doctor.json'}")
    return EXIT_RUN_FAILED if failed else 0


def add_doctor_parser(sub) -> None:
    parser = sub.add_parser("doctor", help="first command on a new box: two-step runs of every mode, sleep level "
                                           "and LoRA setting, weights checked after every sync")
    parser.add_argument("config", nargs="?", help="the run config whose model to check (GPU; e.g. configs/gpu-smoke.yaml)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    parser.add_argument("--case", action="append", metavar="PATTERN",
                        help="run only the cases matching this pattern, e.g. 'native/colocated/*' (repeatable)")
    parser.add_argument("--nproc", type=int, help="ranks per case (default: every GPU; 2 on CPU)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--out", help="folder for the case runs and doctor.json (default: runs/doctor-TIME)")
    parser.add_argument("--kernels", action="store_true",
                        help="only say which CPU kernels compute here (oneDNN or torch's, the compiled decode loops, "
                             "each verdict and where it came from), then exit")
    parser.set_defaults(func=cmd_doctor)
