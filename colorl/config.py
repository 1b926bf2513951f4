"""The typed run configuration: YAML file + `--set key=value` overrides -> validated `Config`.

Every rejection is a `ConfigError` whose message is one line naming the key, the value and what
is allowed, so the CLI can print it and exit 2 without a traceback.
"""
from __future__ import annotations

import difflib
import importlib.util
import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from colorl.buffer import BUFFERS

ENGINES = ("native", "hf", "sglang", "vllm")
TASKS = ("arithmetic", "countdown", "jsonl", "hf_dataset")
MODES = ("colocated", "bounded_lag")


class ConfigError(ValueError):
    """Bad user input; the message is a single line meant for the terminal."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WandbConfig(Section):
    project: str = "colorl"
    name: Optional[str] = None  # null: run.name
    mode: Literal["online", "offline", "disabled"] = "online"


class RunConfig(Section):
    name: str = "run"
    dir: str = "runs"
    seed: int = Field(0, ge=0, lt=2**32)  # torch and the samplers take 32-bit seeds without overflow
    steps: int = Field(20, ge=1)
    save_every: int = Field(10, ge=0)  # 0: only at the end
    keep_checkpoints: int = Field(2, ge=0)  # newest N kept after each save; 0: keep all
    optimizer_state: Literal["newest", "all"] = "newest"  # which checkpoints keep the optimizer state
    eval_every: int = Field(0, ge=0)  # 0: no periodic eval
    eval_prompts: int = Field(32, ge=0)
    log_samples_every: int = Field(5, ge=0)  # decoded samples to RUN_DIR/samples.jsonl and the screen; 0: never
    tensorboard: bool = False
    wandb: Optional[WandbConfig] = None  # Weights & Biases tracking; null: off


class LoraConfig(Section):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class ModelConfig(Section):
    path: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: Optional[LoraConfig] = None
    system_prompt: Optional[str] = None
    architecture: Optional[str] = None  # a config.json `colorl plan` reads when model.path is not here


class TaskConfig(Section):
    name: Literal["arithmetic", "countdown", "jsonl", "hf_dataset"] = "arithmetic"
    path: Optional[str] = None  # jsonl: file with {"prompt", "answer"} lines
    eval_path: Optional[str] = None
    # "module:function", or a list of them ("task": the task's own reward) summed with reward_weights
    reward: Union[str, list[str], None] = None
    reward_weights: Optional[list[float]] = None  # one per function of task.reward; null: 1 each
    reward_timeout_s: float = Field(5.0, gt=0)
    options: dict[str, Any] = {}  # task-specific knobs, checked by the task itself
    # multi-turn episodes: a registered environment ("calculator") or "module:Class" (docs/tasks.md);
    # it gives the opening messages, answers each model message and owns the reward (task.reward unused)
    env: Optional[str] = None
    env_options: dict[str, Any] = {}  # keyword arguments of the environment's constructor: Env(problem, **env_options)
    max_turns: int = Field(4, ge=1)  # model messages per episode; not ended by then: reward 0
    turn_tokens: Optional[int] = Field(None, ge=1)  # per model message; null: rollout.max_new_tokens
    episode_tokens: int = Field(1024, ge=1)  # after the opening prompt, model and environment tokens
    env_timeout_s: float = Field(30.0, gt=0)  # per reset or step; past it the episode ends with reward 0
    env_workers: int = Field(8, ge=1)  # threads running environment code, off the engine's loop


class LengthOverride(Section):
    mean: float = Field(64, gt=0)
    tailness: float = Field(90, ge=0, le=100)
    cap: int = Field(512, ge=1)


class RolloutConfig(Section):
    engine: Literal["native", "hf", "sglang", "vllm"] = "native"
    group_size: int = Field(4, ge=2)
    batch_groups: int = Field(8, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    concurrency: int = Field(32, ge=1)  # C: sequences in flight over all ranks (caps engine.max_num_seqs)
    length_override: Optional[LengthOverride] = None


class TrainConfig(Section):
    lr: float = Field(1.0e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # micro-batches are cut by tokens (sequences packed, no padding), longest sequences first;
    # null: the device's default (MICRO_BATCH_TOKENS)
    max_tokens_per_micro_batch: Optional[int] = Field(None, ge=1)
    # rows of the [tokens, vocab] logits the LM head computes at a time (bounds that temporary)
    logits_chunk_tokens: int = Field(512, ge=1)
    grad_clip: float = Field(1.0, gt=0)
    # this many steps in a row with a non-finite loss or gradient norm stop the run (checkpoint of the
    # last good step); fewer are skipped (no optimizer step) and counted in optimizer_steps_skipped
    max_nonfinite_in_a_row: int = Field(3, ge=1)
    offload_optimizer: bool = False
    # recompute each decoder layer's activations in backward instead of keeping them
    activation_checkpointing: bool = False
    # compute dtype of forward/backward (FSDP2 mixed precision); weights, optimizer state and
    # gradient reduction stay in model.dtype. null: compute in model.dtype; auto: bf16 where this
    # machine's race says it is faster (colorl/precision.py), else model.dtype
    mixed_precision: Optional[Literal["auto", "bfloat16", "float16"]] = "auto"


# train.max_tokens_per_micro_batch where it is null, per device type. On a CPU a micro-batch of
# about TRL's 8 completions is as fast as 2048 tokens and holds a GiB less, below TRL's peak at
# equal settings (bench/README.md, "the frontier", issue 31); a GPU's products want more rows.
MICRO_BATCH_TOKENS = {"cpu": 1024, "cuda": 2048}


def micro_batch_tokens(train: TrainConfig, device: str) -> int:
    """The token budget of one forward/backward on `device` ("cpu", "cuda" or "cuda:N")."""
    if train.max_tokens_per_micro_batch is not None:
        return train.max_tokens_per_micro_batch
    return MICRO_BATCH_TOKENS[device.split(":")[0]]


class LossConfig(Section):
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    tis_cap: float = Field(2.0, gt=0)
    std_norm: bool = True
    kl_coef: float = Field(0.0, ge=0)
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"


class FilterConfig(Section):
    zero_variance: bool = False
    # an episode whose environment faulted: left out of its group's mean and spread (exclude), or its reward 0 counted (reward_0)
    env_faults: Literal["exclude", "reward_0"] = "exclude"


class RedundancyConfig(Section):
    """Redundant rollout: over-sample, abort the slowest once a buffer (batch) or a group is full."""

    level: Literal["batch", "group"] = "group"
    ratio: float = Field(0.25, gt=0, le=4)  # extra groups per buffer (batch) or samples per group (group)


class StalenessConfig(Section):
    max: int = Field(1, ge=0)  # η: no group is trained staler than this (staleflow, queue_max)
    buffer: Literal[tuple(BUFFERS)] = "staleflow"  # the names colorl.buffer registers
    queue_factor: float = Field(1.0, ge=1)
    # in-flight samples when new weights arrive: continue on their KV, or re-prefill under the new weights
    partial_rollout: Literal["keep", "recompute"] = "keep"
    redundancy: Optional[RedundancyConfig] = None  # off by default: it shifts the length distribution


class SyncConfig(Section):
    bucket_mb: float = Field(256, gt=0)


class EngineConfig(Section):
    memory_fraction: float = Field(0.5, gt=0, le=1)
    block_size: int = Field(16, ge=1)
    num_blocks: Optional[int] = Field(None, ge=1)  # explicit KV pool size; overrides memory_fraction
    max_num_seqs: int = Field(64, ge=1)
    max_prefill_tokens: int = Field(2048, ge=16)  # chunked prefill budget per step
    decode_burst: int = Field(8, ge=1)  # native engine: decode steps per compiled call while every sequence decodes
    sleep_level: Optional[Literal[1, 2]] = None  # null: Config.sleep_level chooses
    # served dtype; null: model.dtype; auto: bf16 where train.mixed_precision's auto picks it
    dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]] = "auto"
    weights_cpu_backup: bool = False  # a host copy of the weights while asleep at level 2 (LoRA turns it on)
    in_flight_updates: bool = False  # set from `mode`: weights change while requests run (bounded-lag)


class LaunchConfig(Section):
    nproc: int = Field(1, ge=1, le=64)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    collective_timeout_s: float = Field(600, gt=0)  # a rank stuck longer than this ends the run
    # bounded-lag mode: intra-op threads of each loop on a rank (null: split the rank's cores)
    rollout_threads: Optional[int] = Field(None, ge=1)
    train_threads: Optional[int] = Field(None, ge=1)


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    loss: LossConfig = LossConfig()
    filter: FilterConfig = FilterConfig()
    mode: Literal["colocated", "bounded_lag"] = "colocated"
    staleness: StalenessConfig = StalenessConfig()
    sync: SyncConfig = SyncConfig()
    engine: EngineConfig = EngineConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        nproc = self.launch.nproc
        if self.rollout.batch_groups % nproc:
            raise ValueError(
                f"rollout.batch_groups={self.rollout.batch_groups} must be divisible by launch.nproc={nproc}"
            )
        if self.task.name in ("jsonl", "hf_dataset") and not self.task.path:
            raise ValueError(f"task.path is required when task.name={self.task.name}")
        redundancy = self.staleness.redundancy
        if redundancy is not None and redundancy.level == "batch" and self.staleness.buffer != "staleflow":
            raise ValueError("staleness.redundancy.level=batch needs staleness.buffer=staleflow "
                             "(the queues already over-draw: they drop or discard groups)")
        if self.task.env and self.rollout.length_override is not None:
            raise ValueError("rollout.length_override draws one completion's length; it does not apply to "
                             "multi-turn episodes (task.env): use task.turn_tokens and task.episode_tokens")
        if self.task.env_options and not self.task.env:
            raise ValueError("task.env_options are the environment's arguments: set task.env too")
        check_reward_list(self.task.reward, self.task.reward_weights)
        if self.task.env and self.task.reward:
            raise ValueError("task.reward: with task.env the environment gives each episode's reward; set one or the other")
        if self.rollout.engine == "sglang" and self.launch.device == "cpu":
            raise ValueError("rollout.engine=sglang needs CUDA; use native or hf with launch.device=cpu")
        if self.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.engine=vllm: the vllm package is not installed (pip install 'colorl[vllm]' on "
                             "CUDA, make setup-vllm on x86 CPUs); engines this machine can run: "
                             + ", ".join(map(repr, runnable_engines())))
        return self

    @property
    def sleep_level(self) -> int:
        """engine.sleep_level, or where it is null the level that costs nothing: 2 for the native engine
        in colocated mode without LoRA, whose every sync rewrites all its weights in place (releasing
        them between rollouts gives the training phase their memory), else 1."""
        if self.engine.sleep_level is not None:
            return self.engine.sleep_level
        return 2 if self.rollout.engine == "native" and self.mode == "colocated" and self.model.lora is None else 1

    @property
    def rollouts_per_step(self) -> int:
        """B = G·S, over all ranks."""
        return self.rollout.batch_groups * self.rollout.group_size


def check_reward_list(reward, weights) -> None:
    """The list form of task.reward (TRL's reward_funcs + reward_weights): one weight per function,
    finite weights, names whose metrics (`reward/<function>`) do not collide."""
    if weights is None:
        if reward == []:
            raise ValueError("task.reward=[]: give at least one reward function, or null for the task's own")
        specs = reward if isinstance(reward, list) else []
    else:
        if not reward:
            raise ValueError("task.reward_weights: set task.reward too (the functions the weights are for)")
        specs = reward if isinstance(reward, list) else [reward]
        if len(weights) != len(specs):
            raise ValueError(f"task.reward_weights: {len(weights)} weight{'s' * (len(weights) != 1)} for "
                             f"{len(specs)} reward function{'s' * (len(specs) != 1)} in task.reward; give one per function")
        bad = [w for w in weights if not math.isfinite(w)]
        if bad:
            raise ValueError(f"task.reward_weights: {bad[0]} is not a finite number")
    names = [spec.partition(":")[2] or spec for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"task.reward: two reward functions named {repeated[0]!r}; their metrics "
                         f"(reward/{repeated[0]}) would collide")


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Read YAML, apply `key=value` overrides, validate; raise ConfigError with one line on any problem."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_config_file(Path(path))
    for item in overrides or []:
        apply_override(raw, item)
    config = validate(raw)
    if path is not None and not _names_model(raw):  # the default model would train silently
        raise ConfigError(f"{path}: names no model: set model.path (a local Hugging Face folder, "
                          f"a hub id, or an alias such as smollm2-135m-instruct)")
    if check_paths:
        check_external(config)
    return config


def read_config_file(file: Path) -> dict[str, Any]:
    """The YAML mapping of a config file; one-line ConfigError for anything else."""
    if not _is_file(file):
        raise ConfigError(f"config file not found: {file}")
    text = read_text(file, ConfigError)
    raw = _parse_yaml(text, f"{file}:", ConfigError)
    if raw is None:
        raise ConfigError(f"{file}: empty config file (it needs at least model.path)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def read_text(file: Path, error: type[Exception]) -> str:
    """A user file as UTF-8 text; `error` with one line naming the file if it is unreadable or not UTF-8."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise error(f"{file}: cannot read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{file}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def _parse_yaml(text: str, where: str, error: type[Exception]) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise error(f"{where}{line} is not valid YAML ({problem})") from None
    except RecursionError:
        raise error(f"{where} is nested too deeply to be a config") from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name too long for the file system: not a file we can use
        return False


def _names_model(raw: dict[str, Any]) -> bool:
    model = raw.get("model")
    return isinstance(model, dict) and bool(model.get("path"))


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b.c=value`, the value parsed as YAML so numbers, booleans and whole sections work."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value")
    key, text = item.split("=", 1)
    value = _parse_yaml(text, f"--set {key}: value {text!r}", ConfigError)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: expected a dotted key such as run.steps=3")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, raw)) from None


_UNION_TAGS = ("str", "int", "float", "bool")  # pydantic names the member of a union it tried (task.reward)


def _one_line(exc: ValidationError, raw: dict[str, Any]) -> str:
    error = exc.errors()[0]
    kind = error["type"]
    parts = [str(p) for p in error["loc"]]
    if kind == "extra_forbidden":  # its last part is the user's key, whatever it looks like ('str', 'literal[')
        parts, key_part = parts[:-1], parts[-1:]
    else:
        key_part = []
    loc = [p for p in parts if not p.startswith(("function-", "literal[", "list[", "dict[")) and p not in _UNION_TAGS]
    loc += key_part
    key = ".".join(loc)
    if kind == "extra_forbidden":
        return f"unknown key {key!r}{_did_you_mean(loc)}"
    if kind == "value_error" and not loc:
        return str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    if key == "rollout.engine" and kind == "literal_error":
        return f"{key}={value!r}: engines this machine can run: {', '.join(map(repr, runnable_engines()))}"
    section = _model_at(loc) if kind in ("model_type", "model_attributes_type", "dict_type") else None
    if section is not None:  # `--set model.lora=8`: a section given a single value
        example = ", ".join(f"{name}: {field.default}" for name, field in list(section.model_fields.items())[:2])
        return f"{key}={value!r}: {key} is a section; give its keys, e.g. --set '{key}={{{example}}}'"
    allowed = _allowed(error)
    return f"{key}={value!r}: {allowed}"


def runnable_engines() -> list[str]:
    """Engines worth offering here: sglang only with CUDA and the sglang package installed, vllm where installed."""
    import torch

    names = ["native", "hf"]
    if torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None:
        names.append("sglang")
    if importlib.util.find_spec("vllm") is not None:
        names.append("vllm")
    return names


def _allowed(error: dict) -> str:
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "literal_error":
        return f"allowed: {ctx.get('expected')}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}"
    return str(error["msg"]).lower()


def _model_at(parts: list[str]) -> type[BaseModel] | None:
    """The config section class at a dotted key (None: not a section)."""
    model: type[BaseModel] = Config
    for part in parts:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return None
        model = candidates[0]
    return model


def _did_you_mean(loc: list[str]) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    prefix = ".".join(loc[:-1] + close[:1])
    return f" (did you mean {prefix!r}?)" if close else f"; allowed: {sorted(model.model_fields)}"


def check_external(config: Config) -> None:
    """Checks that touch the disk: model path and folder, task files, what the engine can do. User
    code (a reward, an environment) is resolved before launch, by colorl/preflight.py: the config
    stays data that every layer may read, importing none of them."""
    from colorl.models import ModelNotFound, check_model_path

    try:
        check_model_path(config.model.path)
        folder = Path(config.model.path).expanduser()
        local = (folder / "config.json").is_file()
    except ModelNotFound as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, RuntimeError) as exc:  # a name too long for the file system, `~user` of no such user
        raise ConfigError(f"model.path={config.model.path!r}: not a usable path "
                          f"({getattr(exc, 'strerror', None) or exc})") from None
    if local:
        check_model_folder(folder, config.rollout.engine)
    for key in ("path", "eval_path"):
        value = getattr(config.task, key)
        if value and config.task.name == "jsonl" and not _is_file(Path(value)):
            raise ConfigError(f"task.{key}={value!r}: file not found")
    check_engine_modes(config)


def check_engine_modes(config: Config) -> None:
    """What the chosen engine can do: bounded-lag's `partial_rollout: keep` needs KV kept across updates."""
    if config.mode != "bounded_lag" or config.staleness.partial_rollout != "keep":
        return
    from colorl.engines import engine_class

    if not engine_class(config.rollout.engine).keeps_kv_across_updates:
        raise ConfigError(f"staleness.partial_rollout=keep: rollout.engine={config.rollout.engine} cannot keep "
                          "in-flight sequences across a weight update; use staleness.partial_rollout=recompute")


def check_model_folder(folder: Path, engine: str) -> None:
    """A local model folder must hold a readable config of a family the chosen engine runs."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many types for a broken folder
        raise ConfigError(f"model.path={str(folder)!r}: unreadable model config ({type(exc).__name__}: {exc})"
                          .splitlines()[0]) from None
    if engine == "native":
        from colorl.engines.native.model import ModelSpec

        try:
            ModelSpec.from_hf_config(hf_config)
        except (ValueError, NotImplementedError) as exc:
            raise ConfigError(f"model.path={str(folder)!r}: {exc}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
