"""`colorl plan`: the per-device arithmetic on models built from config (Qwen2.5-1.5B and 7B, on the
meta device), the knob it names when a run does not fit, the example GPU configs, and the
activation estimate against a measured CPU training step."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from colorl.cli import main
from colorl.config import load_config
from colorl.models import meta_model
from colorl.plan import GiB, Architecture, parse_size, plan_memory, plan_with_advice

ROOT = Path(__file__).resolve().parents[1]
QWEN25_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0)
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0)
EXAMPLES = {"configs/gpu8-qwen2.5-1.5b.yaml": QWEN25_1_5B, "configs/gpu8-qwen2.5-7b-lora.yaml": QWEN25_7B}


def hf(spec: dict):
    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def gpu_config(path="configs/gpu8-qwen2.5-1.5b.yaml", *overrides):
    return load_config(ROOT / path, list(overrides), check_paths=False)


def test_parameter_counts_are_the_published_sizes():
    small, large = Architecture.from_hf_config(hf(QWEN25_1_5B)), Architecture.from_hf_config(hf(QWEN25_7B))
    assert small.params == pytest.approx(1.54e9, abs=0.006e9)  # model cards: 1.54B and 7.61B
    assert large.params == pytest.approx(7.61e9, abs=0.006e9)
    assert small.layer_params * 28 < small.params < (small.layer_params + 1) * 28 + small.vocab * 1536 + 1536


def test_lora_count_agrees_with_peft():
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    arch = Architecture.from_hf_config(hf(QWEN25_7B), targets, 32)
    peft_model = get_peft_model(meta_model(hf(QWEN25_7B)), LoraConfig(r=32, target_modules=targets))
    assert arch.lora_params == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert arch.adapted_params == sum(m.weight.numel() for n, m in meta_model(hf(QWEN25_7B)).named_modules()
                                      if n.rsplit(".", 1)[-1] in targets)


def test_per_device_lines_by_hand():
    # 8 ranks, float32 weights with bf16 compute, 8192-token micro-batches, max_new_tokens 1024, memory_fraction 0.5
    cfg = gpu_config()
    arch = Architecture.from_hf_config(hf(QWEN25_1_5B))
    memory, prompt = 80 * GiB, 200
    plan = plan_memory(cfg, arch, memory, prompt)
    lines = {name: line.bytes for name, line in plan.lines.items()}
    p = arch.params
    assert lines["trainer weights"] == -(-p * 4 // 8) and lines["gradients"] == -(-p * 4 // 8)
    assert lines["optimizer state"] == -(-2 * p * 4 // 8)
    assert lines["engine weights"] == 2 * p  # served in bf16 (engine.dtype) from float32 master weights
    # SGLang keeps (1 - f) of what was free before it loaded (kv_pool_runtime.py): f·(M − resident) − weights
    assert lines["engine KV cache"] == int(0.5 * (memory - lines["trainer weights"] - GiB)) - 2 * p
    assert plan.kv_tokens == lines["engine KV cache"] // (2 * 28 * 2 * 128 * 2)  # 2 kv heads of 128, bf16
    h, i, v = 1536, 8960, 151936
    norm = 2 * h + 4  # lean RMSNorm, bf16 compute: the input and a float32 1/rms
    # 10 h: 8 h + the varlen concat; 4 i: gate and up; 6 i: the top layer's MLP backward, three [T, i] rows
    per_token = 28 * (2 * norm + 10 * h + 4 * i) + norm + 4 * h + 12 + 6 * i
    tokens = max(cfg.train.max_tokens_per_micro_batch, prompt + 1024)
    head = min(tokens, cfg.train.logits_chunk_tokens) * 18 * v  # the LM head's logits, one chunk at a time
    assert lines["activations"] == tokens * per_token + head
    rollout, train, sync = (plan.phase_bytes(phase) for phase in plan.phases)
    # the optimizer is offloaded between train phases; the engine keeps its weights at sleep level 1
    assert rollout == sum(lines[k] for k in ("trainer weights", "engine weights", "engine KV cache", "reserve"))
    assert train == sum(lines[k] for k in ("trainer weights", "gradients", "optimizer state", "activations",
                                            "unsharded layers", "engine weights", "reserve"))
    assert sync == sum(lines[k] for k in ("trainer weights", "engine weights", "sync buckets", "reserve"))


def test_phases_follow_offload_sleep_level_and_mode():
    arch = Architecture.from_hf_config(hf(QWEN25_1_5B))

    def phase(name, *overrides):
        plan = plan_memory(gpu_config("configs/gpu8-qwen2.5-1.5b.yaml", *overrides), arch, 80 * GiB, 200)
        return plan, next(p for p in plan.phases if p.name == name)

    plan, rollout = phase("rollout", "train.offload_optimizer=false")
    assert "optimizer state" in rollout.parts
    plan, train = phase("train", "engine.sleep_level=2")
    assert "engine weights" not in train.parts
    plan, train = phase("train", "mode=bounded_lag")
    assert {"engine weights", "engine KV cache"} <= set(train.parts)


def test_a_run_that_does_not_fit_names_the_knob_that_makes_it_fit():
    arch = Architecture.from_hf_config(hf(QWEN25_1_5B))
    cfg = gpu_config("configs/gpu8-qwen2.5-1.5b.yaml", "train.max_tokens_per_micro_batch=49152")
    plan = plan_with_advice(cfg, arch, 80 * GiB, 200)
    assert not plan.fits and plan.peak.name == "train"
    # activations are what does not fit: checkpointing comes first, and so would a smaller micro-batch
    assert "does not fit" in plan.verdict() and "set train.activation_checkpointing=true" in plan.verdict()
    checkpointed = gpu_config("configs/gpu8-qwen2.5-1.5b.yaml", "train.max_tokens_per_micro_batch=49152",
                              "train.activation_checkpointing=true")
    assert plan_memory(checkpointed, arch, 80 * GiB, 200).fits
    budget = "train.max_tokens_per_micro_batch"
    assert plan_memory(gpu_config("configs/gpu8-qwen2.5-1.5b.yaml", f"{budget}=32768"), arch, 80 * GiB, 200).fits
    assert not plan_memory(gpu_config("configs/gpu8-qwen2.5-1.5b.yaml", f"{budget}=49152"), arch,
                           80 * GiB, 200).fits

    full_7b = gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "model.lora=null", "launch.nproc=1",
                         "rollout.batch_groups=1")
    hopeless = plan_with_advice(full_7b, Architecture.from_hf_config(hf(QWEN25_7B)), 10 * GiB, 200)
    assert not hopeless.fits and "no combination of up to three knobs" in hopeless.verdict()


def test_when_no_single_knob_fits_the_plan_names_the_combination_that_does():
    """Issue 30 defect 5: full Qwen2.5-7B on one 32 GB card fits with none of the knobs alone; the plan
    names the fewest that fit together, and the config they describe does fit."""
    arch = Architecture.from_hf_config(hf(QWEN25_7B))
    full_7b = gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "model.lora=null", "launch.nproc=1",
                         "rollout.batch_groups=1", "train.activation_checkpointing=false")
    card = parse_size("32GB")
    plan = plan_with_advice(full_7b, arch, card, 200)
    advice = plan.verdict().split("; set ", 1)[1].split(" together (then", 1)[0]
    changes = advice.split(" and ")
    assert not plan.fits and len(changes) >= 2, plan.verdict()
    assert all(not plan_with_advice(gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "model.lora=null", "launch.nproc=1",
                                               "rollout.batch_groups=1", "train.activation_checkpointing=false",
                                               *change.split(" with ")), arch, card, 200).fits for change in changes)
    combined = gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "model.lora=null", "launch.nproc=1",
                          "rollout.batch_groups=1", "train.activation_checkpointing=false",
                          *[part for change in changes for part in change.split(" with ")])
    assert plan_memory(combined, arch, card, 200).fits


def test_gpu_memory_in_gb_is_what_the_card_reports():
    """Issue 30 defect 5: an "80 GB" H100 reports 79.1-79.2 GiB of total memory to torch; `--gpu-memory 80GB`
    plans for that, not for 80 GiB, and exact sizes stay exact."""
    assert 79.0 * GiB < parse_size("80GB") <= 79.15 * GiB
    assert parse_size("79.5GiB") == int(79.5 * GiB) and parse_size("24") == 24 * GiB
    assert parse_size("512MiB") == 512 * 2**20


def test_lora_counts_peft_float32_input_casts_and_the_head_one_chunk_at_a_time():
    """Issue 19 defect 10: below float32 compute, peft casts each adapted module's input to the
    adapters' float32 and keeps it (4 bytes x in_features per token); the LM head's logits exist
    for `train.logits_chunk_tokens` rows, not for every token of the micro-batch."""
    cfg = gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "train.activation_checkpointing=false")
    lora = cfg.model.lora
    arch = Architecture.from_hf_config(hf(QWEN25_7B), lora.targets, lora.r)
    h, i = 3584, 18944
    kv = 4 * 128
    assert arch.lora_inputs == 28 * (h + h + h + h + h + h + i)  # q k v o gate up take h, down takes i
    b = 2
    product = 28 * i  # the wrapped down projection keeps the lean MLP's gated product (per byte of b)
    assert arch.activation_bytes_per_token(b, lora=True) - arch.activation_bytes_per_token(b) == (4 * arch.lora_inputs
                                                                                                 + b * product)
    assert arch.activation_bytes_per_token(4, lora=True) - arch.activation_bytes_per_token(4) == 4 * product  # no cast
    tokens = 4096
    assert arch.activation_bytes(tokens, b, 512, lora=True) == (tokens * arch.activation_bytes_per_token(b, True)
                                                                + 512 * (b + 16) * arch.vocab)
    plan = plan_memory(cfg, arch, 80 * GiB, 200)
    assert plan.lines["activations"].bytes == arch.activation_bytes(tokens, b, cfg.train.logits_chunk_tokens, True)
    assert kv == arch.kv_dim


def test_engine_fraction_too_small_for_the_weights_is_reported():
    arch = Architecture.from_hf_config(hf(QWEN25_7B), ["q_proj"], 8)
    plan = plan_with_advice(gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "engine.memory_fraction=0.1"),
                            arch, 80 * GiB, 200)
    assert plan.kv_tokens <= 0 and not plan.fits
    assert "no KV cache" in plan.verdict() and "engine.memory_fraction=" in plan.verdict()


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_example_gpu_configs_validate_and_fit_an_80gb_card(path, tmp_path, capsys):
    model_config = tmp_path / "config.json"
    model_config.write_text(json.dumps({**EXAMPLES[path], "architectures": ["Qwen2ForCausalLM"]}))
    assert main(["train", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout:\n  engine: sglang" in out and "launch: 8 x cuda" in out
    assert "could not be checked on this machine" in out
    assert main(["plan", path, "--model-config", str(model_config), "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "could not be checked on this machine" in out and "\nfits: " in out and "engine KV cache" in out


def test_plan_bad_input_is_one_line(tmp_path, capsys):
    assert main(["plan", "configs/gpu8-qwen2.5-1.5b.yaml", "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-memory" in err[0]
    assert main(["plan", "configs/gpu8-qwen2.5-1.5b.yaml", "--set", "model.path=Qwen/NotHere-0B",
                 "--set", "model.architecture=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model-config" in err[0] and "model.architecture" in err[0]
    assert main(["plan", "configs/gpu8-qwen2.5-1.5b.yaml", "--set", "model.path=Qwen/NotHere-0B",
                 "--set", "model.architecture=no/such.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.architecture 'no/such.json': file not found" in err[0]


def test_plan_of_the_tiny_cpu_config_measures_its_prompts(capsys):
    assert main(["plan", "configs/tiny.yaml"]) == 0  # launch.device auto: this CPU machine
    out = capsys.readouterr().out
    assert "prompt length: longest of 64 task prompts" in out and "fits:" in out


def _measured_activations(model_dir: Path, micro: int, seq: int, checkpointed: bool = False) -> int:
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "measure_train_peak.py"), str(model_dir),
                           str(micro), str(seq), *(["checkpointed"] if checkpointed else [])],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # without checkpointing the peak comes at the end of backward, every gradient allocated; with it,
    # at the start of backward (the last layer recomputed), before the layers' gradients exist
    return figures["peak_rise"] - (0 if checkpointed else figures["grads"])


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_activation_estimate_against_a_measured_cpu_step(tmp_path, checkpointed):
    """A float32 training step on CPU: the peak rise of resident memory over the step, less the
    gradients it allocates, against the plan's activations; two depths separate the per-layer part
    (with activation checkpointing, a layer's input)."""
    from colorl.models import save_tiny_model

    micro, seq = 8, 256
    measured, planned = {}, {}
    for layers in (2, 6):
        folder = save_tiny_model(tmp_path / f"l{layers}", hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
        measured[layers] = _measured_activations(folder, micro, seq, checkpointed)
        planned[layers] = micro * seq * Architecture.from_hf_config(AutoConfig.from_pretrained(folder)) \
            .activation_bytes_per_token(4, checkpointed=checkpointed)
    slope_measured = (measured[6] - measured[2]) / 4
    slope_planned = (planned[6] - planned[2]) / 4
    assert slope_planned == pytest.approx(slope_measured, rel=0.05 if not checkpointed else 0.15)
    for layers in (2, 6):
        assert planned[layers] == pytest.approx(measured[layers], rel=0.15), (layers, planned, measured)


@pytest.mark.cuda
def test_cuda_run_logs_memory_per_phase_within_the_plan(tmp_path):
    """On a GPU: metrics carry allocated/reserved/per-phase peaks, and the train phase's measured
    peak stays under the plan's figure for it."""
    from colorl.plan import plan_for_run
    from colorl.models import resolve_model_path

    import torch

    run_dir = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", "--device", "cuda", "--run-dir", str(run_dir)]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {"cuda_allocated_gb", "cuda_reserved_gb", "cuda_peak_rollout_gb", "cuda_peak_train_gb", "cuda_peak_sync_gb"}
    assert all(keys <= set(record) for record in records)
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["launch.device=cuda"])
    plan = plan_for_run(cfg, resolve_model_path(cfg.model.path), torch.cuda.get_device_properties(0).total_memory)
    train = next(p for p in plan.phases if p.name == "train")
    assert max(r["cuda_peak_train_gb"] for r in records) * GiB <= plan.phase_bytes(train)


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_shipped_gpu_examples_plan_offline(path, capsys, monkeypatch):
    """Issue 19 defect 10: the README's `colorl plan configs/gpu8-...` works on a machine that cannot reach
    the model hub: the examples ship the architecture (model.architecture), the same as the published one."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = gpu_config(path)
    shipped = json.loads((ROOT / cfg.model.architecture).read_text())
    assert {k: shipped[k] for k in EXAMPLES[path]} == EXAMPLES[path]
    assert main(["plan", path, "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "\nfits: " in out and "engine KV cache" in out


def _with_vllm(cfg):
    """The same config with rollout.engine=vllm (built past validation, which wants vLLM installed here)."""
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "vllm"})})


def test_vllm_takes_its_fraction_of_the_whole_device_and_colorl_keeps_a_staging_copy():
    """vLLM 0.32: a budget of f·M of the device, all free at its start; its KV pool is what its weights
    leave of the budget; colorl's checkpoint-format copy of the engine's weights is resident throughout."""
    arch = Architecture.from_hf_config(hf(QWEN25_1_5B))
    cfg = _with_vllm(gpu_config())
    plan = plan_memory(cfg, arch, 80 * GiB, 200)
    engine_weights = plan.lines["engine weights"].bytes
    assert plan.lines["engine KV cache"].bytes == int(cfg.engine.memory_fraction * 80 * GiB) - engine_weights
    assert plan.lines["engine staging copy"].bytes == engine_weights
    assert all("engine staging copy" in phase.parts for phase in plan.phases)
    assert plan_memory(gpu_config(), arch, 80 * GiB, 200).lines["engine staging copy"].bytes == 0  # native


def test_a_vllm_budget_that_leaves_no_room_names_engine_memory_fraction():
    arch = Architecture.from_hf_config(hf(QWEN25_7B))
    full = gpu_config("configs/gpu8-qwen2.5-7b-lora.yaml", "model.lora=null", "train.offload_optimizer=true",
                      "engine.memory_fraction=0.9")
    plan = plan_with_advice(_with_vllm(full), arch, 80 * GiB, 200)
    assert not plan.fits and "engine.memory_fraction=" in plan.verdict(), plan.render()


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_shipped_gpu_examples_leave_a_margin_on_an_80gb_card(path):
    """Issue 30 defect 5: the 7B LoRA example planned its train phase at 79.15 GiB, more than an 80 GB H100
    reports (79.1-79.2 GiB). Every example's largest phase leaves at least a tenth of the card free, for
    what the plan does not count (fragmentation, kernels' workspaces), at the longest prompt the tasks give."""
    cfg = gpu_config(path)
    lora = cfg.model.lora
    arch = Architecture.from_hf_config(hf(EXAMPLES[path]), lora.targets if lora else None, lora.r if lora else 0)
    card = parse_size("80GB")
    plan = plan_memory(cfg, arch, card, 256)
    assert plan.fits and plan.phase_bytes(plan.peak) <= 0.9 * card, plan.render()
