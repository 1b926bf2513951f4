"""The training engine on one process: degenerate batches never poison the weights."""
from __future__ import annotations

import math

import torch

from colorl.config import load_config
from colorl.train.packing import TrainBatch
from colorl.train.policy import PolicyTrainer


def _batch(n: int = 4, length: int = 10, vocab: int = 200) -> TrainBatch:
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (n, length))
    response = torch.zeros(n, length)
    response[:, 6:] = 1
    behaviour = torch.full((n, length), -5.0) * response
    return TrainBatch.from_sequences([(ids[i].tolist(), response[i].tolist(), behaviour[i].tolist()) for i in range(n)],
                                     torch.tensor([1.0, -1.0, 0.5, -0.5])[:n])


def _trainer(tiny_model_dir, *sets):
    cfg = load_config("configs/tiny.yaml", ["train.max_tokens_per_micro_batch=20", *sets], check_paths=False)
    return PolicyTrainer(tiny_model_dir, cfg, "cpu")


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_fully_masked_batch_trains_nothing_and_stays_finite(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    before = _weights(trainer)
    batch = _batch()
    batch.response_mask.zero_()
    stats = trainer.train_step(batch)
    assert stats.loss == 0.0 and stats.tokens == 0 and math.isfinite(stats.grad_norm)
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_a_non_finite_gradient_skips_the_optimizer_step(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    before = _weights(trainer)
    batch = _batch()
    batch.advantages[0] = float("nan")
    stats = trainer.train_step(batch)
    assert not math.isfinite(stats.grad_norm) and trainer.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    trainer.train_step(_batch())  # the next good batch trains as usual
    assert trainer.skipped_steps == 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_sequence_mean_counts_only_rows_that_are_trained(tiny_model_dir):
    """Masking half the rows (zero-variance groups) must not halve the loss of the others."""
    full, half = _trainer(tiny_model_dir, "loss.aggregation=seq_mean"), _trainer(tiny_model_dir, "loss.aggregation=seq_mean")
    kept = _batch(n=2)
    both = _batch(n=4)
    both.input_ids[:20], both.behaviour_logp[:20], both.advantages[:2] = kept.input_ids, kept.behaviour_logp, kept.advantages
    both.response_mask[20:] = 0
    assert math.isclose(full.train_step(kept).loss, half.train_step(both).loss, rel_tol=1e-5)


def test_a_cpu_trainer_settles_its_heap_after_each_micro_batch_and_releases_it_after_the_step(tiny_model_dir, monkeypatch):
    """colorl/heap.py: where the trainer has freed what it used, its kept heap is bounded."""
    trainer = _trainer(tiny_model_dir)
    calls = []
    monkeypatch.setattr(trainer.heap, "settle", lambda: calls.append("settle"))
    monkeypatch.setattr(trainer.heap, "release", lambda: calls.append("release"))
    forward = trainer.token_logprobs
    monkeypatch.setattr(trainer, "token_logprobs", lambda model, micro: (calls.append("forward"), forward(model, micro))[1])
    trainer.train_step(_batch())
    forwards = calls.count("forward")
    assert forwards >= 2  # a 20-token budget: a micro-batch a sequence
    assert calls == ["forward", "settle"] * forwards + ["release"]


def test_a_cpu_trainer_maps_its_large_blocks_apart_only_where_checkpointing_puts_memory_first(tiny_model_dir,
                                                                                             monkeypatch):
    """colorl/heap.py: the allocator's setting is process-wide, so it is recorded here rather than made."""
    import colorl.heap

    asked = []
    monkeypatch.setattr(colorl.heap, "map_large_blocks", lambda: asked.append(True) or True)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")  # a CPU rank's kept heap (launch.CPU_RANK_ENV)
    assert not _trainer(tiny_model_dir).heap.large_blocks_apart and asked == []
    assert _trainer(tiny_model_dir, "train.activation_checkpointing=true").heap.large_blocks_apart and asked == [True]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # the user's own setting: left as it is
    assert not _trainer(tiny_model_dir, "train.activation_checkpointing=true").heap.large_blocks_apart
    assert asked == [True]



def test_a_null_budget_takes_the_devices_default(tiny_model_dir, monkeypatch):
    """train.max_tokens_per_micro_batch: null cuts micro-batches at the device's default (1024 tokens on a
    CPU: colorl/config.py MICRO_BATCH_TOKENS); a set budget wins."""
    from colorl.config import MICRO_BATCH_TOKENS, micro_batch_tokens

    assert MICRO_BATCH_TOKENS["cpu"] < MICRO_BATCH_TOKENS["cuda"]
    null = load_config("configs/tiny.yaml", ["train.max_tokens_per_micro_batch=null"], check_paths=False)
    assert null.train.max_tokens_per_micro_batch is None
    assert micro_batch_tokens(null.train, "cuda:3") == MICRO_BATCH_TOKENS["cuda"]
    for sets, budget, packed in (([], MICRO_BATCH_TOKENS["cpu"], [40]), (["train.max_tokens_per_micro_batch=10"], 10, [10] * 4)):
        trainer = PolicyTrainer(tiny_model_dir, load_config("configs/tiny.yaml", sets, check_paths=False), "cpu")
        assert micro_batch_tokens(trainer.cfg.train, "cpu") == budget
        calls = []
        forward = trainer.token_logprobs
        monkeypatch.setattr(trainer, "token_logprobs", lambda model, micro: (calls.append(micro.input_ids.shape[1]),
                                                                             forward(model, micro))[1])
        trainer.train_step(_batch(n=4, length=10))
        assert calls == packed  # the micro-batches' packed tokens
