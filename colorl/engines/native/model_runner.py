"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits.

The runner owns the KV pool tensor ([layers, num_blocks * block_size, 2, Hkv, D]; slot =
block * block_size + offset) and knows nothing about policies: the scheduler decided who runs,
the sampler decides what is drawn.

Attention groups: with the compiled decode loops (float32 on CPU, `cpu_decode.py`) all decode
sequences of a step form one group that reads each sequence's own blocks, unpadded. Otherwise
they run as padded SDPA calls over their gathered context, sorted by context length and split
into a few buckets when one long context would make the others pad too much
(`bucket_by_length`). Prefill chunks form one more group with padded queries and a causal mask
offset by what is already cached.
"""
from __future__ import annotations

import math
import os

import torch

from colorl.engines.native.host_memory import mapped_empty
from colorl.engines.native.model import AttentionGroup, CausalLM, DecodeBurst, ModelSpec, StepInputs
from colorl.engines.native.scheduler import ScheduledBatch

# A padded SDPA call costs about as much as attending to this many extra cache slots; it decides
# whether splitting the decode batch into length buckets pays off.
GROUP_COST_SLOTS = 256


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    return 2 * spec.num_layers * block_size * spec.kv_size * dtype.itemsize


def kv_pool_blocks(engine_cfg, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> int:
    """KV pool size: `engine.num_blocks` if given, else what `memory_fraction` of the device leaves.

    CUDA: fraction of the device's total memory, minus what is already allocated (the weights).
    CPU: fraction of the host's available memory (pages are touched only when blocks are used).
    Never more than max_num_seqs sequences of max_position_embeddings tokens can use.
    """
    if engine_cfg.num_blocks:
        return engine_cfg.num_blocks
    size = engine_cfg.block_size
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        budget = engine_cfg.memory_fraction * total - torch.cuda.memory_allocated(device)
    else:
        budget = engine_cfg.memory_fraction * _host_available_bytes()
    cap = engine_cfg.max_num_seqs * math.ceil(spec.max_position_embeddings / size)
    blocks = min(int(budget // kv_bytes_per_block(spec, size, dtype)), cap)
    if blocks < 1:
        raise RuntimeError(
            f"engine.memory_fraction={engine_cfg.memory_fraction} leaves no room for one KV block; "
            "raise it or set engine.num_blocks"
        )
    return blocks


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bucket_by_length(lengths: list[int], group_cost: int = GROUP_COST_SLOTS) -> list[int]:
    """Split ascending `lengths` into contiguous buckets minimising sum(group_cost + n * max).

    Returns bucket end indices. Exact dynamic programme; n is at most max_num_seqs.
    """
    n = len(lengths)
    if not n or lengths[-1] * n - sum(lengths) <= group_cost:  # padding is cheaper than a split
        return [n] if n else []
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            cost = best[start] + group_cost + (end - start) * lengths[end - 1]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    ends, end = [], n
    while end > 0:
        ends.append(end)
        end = cut[end]
    return ends[::-1]


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_cache: torch.Tensor | None = None

    # ------------------------------------------------------------ memory
    def allocate_kv(self) -> None:
        spec = self.model.spec
        shape = (spec.num_layers, self.num_blocks * self.block_size, 2, spec.num_kv_heads, spec.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = mapped_empty(shape, self.dtype)
        else:
            self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        # Padding positions read slot 0 (masked out); keep it finite before any block-0 write.
        self.kv_cache[:, 0].zero_()

    def free_kv(self) -> None:
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits [N, V] (float32) for the sequences that sample this step, and their batch indices."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not allocated (engine asleep?)")
        step, sampling = self.prepare(batch)
        return self.model(step, self.kv_cache), sampling

    @torch.inference_mode()
    def run_burst(self, batch: ScheduledBatch, steps: int,
                  draws: list[list[float]]) -> list[dict[int, tuple[int, float]]]:
        """Up to `steps` decode steps of a batch of one-token decodes in one call (`CausalLM.decode_burst`), whose
        blocks hold all of them (`Scheduler.reserve_ahead`), ending at the first step at which a sequence draws one
        of its stop tokens. draws[i][j]: batch item i's uniform at step j. Returns, for each step run, batch index
        -> (token, log-prob)."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not allocated (engine asleep?)")
        step, rows = self.prepare(batch, ahead=steps - 1)
        seqs = [batch.seqs[i] for i in rows]
        slots = [[self._slot(seq.block_table, batch.starts[i] + j) for i, seq in zip(rows, seqs)] for j in range(steps)]
        burst = DecodeBurst(slots=self._tensor(slots), draws=[draws[i][j] for j in range(steps) for i in rows],
                            temperatures=[seq.params.temperature for seq in seqs], stops=[seq.stop_ids for seq in seqs])
        step.slot_mapping = burst.slots[0]  # the same slots, in the burst's tensor (its row 0)
        tokens, logps = self.model.decode_burst(step, self.kv_cache, burst)
        count = len(rows)
        return [dict(zip(rows, zip(tokens[j:j + count], logps[j:j + count]))) for j in range(0, len(tokens), count)]

    def prepare(self, batch: ScheduledBatch, ahead: int = 0) -> tuple[StepInputs, list[int]]:
        """The step's tensors, and the batch index of each row that samples; ahead: steps after this one that the
        compiled decode's block tables must reach too (a burst's)."""
        decodes = sorted((i for i in range(len(batch)) if batch.num_tokens[i] == 1), key=lambda i: batch.starts[i])
        prefills = [i for i in range(len(batch)) if batch.num_tokens[i] > 1]
        compiled = self.model.compiled(self.dtype, self.device) is not None
        groups_of_items: list[list[int]] = []
        start = 0
        if compiled:  # one group: the compiled attention reads each sequence's blocks, unpadded
            ends = [len(decodes)] if decodes else []
        else:
            ends = bucket_by_length([batch.starts[i] + 1 for i in decodes])
        for end in ends:
            groups_of_items.append(decodes[start:end])
            start = end
        if prefills:
            groups_of_items.append(prefills)

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampling: list[int] = []
        groups: list[AttentionGroup] = []
        for items in groups_of_items:
            group_start = len(input_ids)
            for i in items:
                seq, first, n = batch.seqs[i], batch.starts[i], batch.num_tokens[i]
                table = seq.block_table
                input_ids.extend(seq.token_ids[first:first + n])
                positions.extend(range(first, first + n))
                slots.extend(self._slot(table, p) for p in range(first, first + n))
                if batch.sample[i]:
                    logit_rows.append(len(input_ids) - 1)
                    sampling.append(i)
            if compiled and items is not prefills:
                groups.append(self._decode_group(batch, items, group_start, len(input_ids), ahead))
            else:
                groups.append(self._group(batch, items, group_start, len(input_ids)))

        step = StepInputs(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            groups=groups,
            logit_rows=self._tensor(logit_rows),
            max_position=max(positions),
            every_token_samples=len(logit_rows) == len(input_ids),  # rows are appended in order, once each
        )
        return step, sampling

    def _decode_group(self, batch: ScheduledBatch, items: list[int], start: int, end: int,
                      ahead: int = 0) -> AttentionGroup:
        """One-token decodes for the compiled attention: each sequence's block table and length, unpadded; the
        tables wide enough for `ahead` steps more."""
        lengths = [batch.starts[i] + 1 for i in items]
        width = -(-(max(lengths) + ahead) // self.block_size)
        tables = [batch.seqs[i].block_table[:width] for i in items]
        return AttentionGroup(
            start=start, end=end, batch=len(items), q_len=1, kv_len=max(lengths), block_size=self.block_size,
            block_tables=self._tensor([table + [0] * (width - len(table)) for table in tables]),
            lengths=self._tensor(lengths), context_tokens=sum(lengths),
        )

    def _group(self, batch: ScheduledBatch, items: list[int], start: int, end: int) -> AttentionGroup:
        size = self.block_size
        firsts = torch.tensor([batch.starts[i] for i in items])  # [B]
        counts = torch.tensor([batch.num_tokens[i] for i in items])  # [B]
        contexts = firsts + counts  # [B] tokens visible to the last query
        q_len, kv_len = int(counts.max()), int(contexts.max())
        width = -(-kv_len // size)
        tables = torch.zeros(len(items), width, dtype=torch.long)  # [B, blocks]
        for row, i in enumerate(items):
            table = batch.seqs[i].block_table[:width]
            tables[row, :len(table)] = torch.tensor(table)
        kv_pos = torch.arange(kv_len)  # [L]
        kv_slots = (tables[:, :, None] * size + torch.arange(size)).view(len(items), -1)[:, :kv_len]  # [B, L]
        kv_slots = torch.where(kv_pos[None, :] < contexts[:, None], kv_slots, 0)
        q_offsets = torch.arange(q_len)  # [Q]
        # Padded query rows get the last real position, so no row is fully masked (no NaN).
        q_pos = torch.minimum(firsts[:, None] + q_offsets[None, :], contexts[:, None] - 1)  # [B, Q]
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
        q_pad_index = None
        if q_len > 1:
            q_pad_index = (torch.arange(len(items))[:, None] * q_len + q_offsets[None, :])[q_offsets[None, :] < counts[:, None]]
            q_pad_index = q_pad_index.to(self.device)
        return AttentionGroup(
            start=start, end=end, batch=len(items), q_len=q_len, kv_len=kv_len, q_pad_index=q_pad_index,
            kv_slots=kv_slots.reshape(-1).to(self.device), mask=mask[:, None].to(self.device),
        )

    def _slot(self, table: list[int], position: int) -> int:
        """The KV cache slot of a sequence's token at `position`, through its block table."""
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        made = torch.tensor(values, dtype=torch.long)
        return made if self.device.type == "cpu" else made.to(self.device, non_blocking=True)
