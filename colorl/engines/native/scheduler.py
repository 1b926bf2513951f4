"""Continuous batching: which sequences compute how many tokens in the next model step.

Pure Python (no torch). One `schedule()` builds a step in two phases:
1. decode: every running sequence whose only uncomputed token is its last sampled one gets one
   token. If a new KV block is needed and none is free, the most recently admitted running
   sequence is preempted (its blocks freed; it is re-prefilled later, "recompute"), never a crash.
2. prefill: partially prefilled sequences continue, then waiting ones are admitted in order while
   there are free slots (`max_num_seqs`), blocks and prefill budget (`max_prefill_tokens` tokens
   per step; a longer prompt is split into chunks over several steps). On admission the leading
   full blocks of the prompt are looked up in the prefix cache (`BlockManager.match_prefix`).
Full blocks are offered for sharing when they are scheduled: the model runner writes every new
token's KV of a layer before any attention of that layer reads, so a sequence admitted in the
same step can already read them.
Decode and prefill tokens of one step go through the model in one forward.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from colorl.engines.native.block_manager import BlockManager, block_key, chain_root

if TYPE_CHECKING:
    from colorl.engines.base import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # interrupted with its KV kept, until it is resumed or released
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and KV bookkeeping. Tokens whose KV is in the cache: [0, num_computed_tokens)."""

    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: "SamplingParams"
    seed: int  # sampling stream; see sampler.uniform
    stop_ids: frozenset[int] = frozenset()
    logprobs: list[float] = field(default_factory=list)  # one per output token
    versions: list[int] = field(default_factory=list)  # one per output token
    kv_version: int | None = None  # the version that computed the oldest KV now in its cache
    state_version: int | None = None  # the oldest `kv_version` a sampled token read (GenerationResult)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the leading full blocks
    key_epoch: int = -1  # BlockManager epoch the keys were computed in
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens taken from the prefix cache at the last admission

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass
class ScheduledBatch:
    """One model step: sequence i computes tokens [starts[i], starts[i] + num_tokens[i])."""

    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)  # does sequence i get a new token this step?
    preempted: list[Sequence] = field(default_factory=list)
    truncated: list[Sequence] = field(default_factory=list)  # finished for lack of KV capacity

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.starts.append(seq.num_computed_tokens)
        self.num_tokens.append(n)
        self.sample.append(seq.num_computed_tokens + n == seq.num_tokens)  # chunk reaches the last token

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_prefill_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens taken from the prefix cache instead of computed

    # ------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if seq.num_tokens > capacity:
            raise ValueError(
                f"request {seq.request_id!r}: {seq.num_tokens} tokens do not fit the KV pool "
                f"({self.blocks.num_blocks} blocks x {self.blocks.block_size} = {capacity} tokens)"
            )
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.parked.get(request_id)

    def remove(self, request_id: str, keep_kv: bool = False) -> Sequence | None:
        """Take a request out of the engine (abort / interrupt); with keep_kv its blocks stay parked."""
        seq = self.find(request_id)
        if seq is None:
            return None
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            del self.parked[request_id]
        if keep_kv and seq.block_table:
            seq.status = Status.PARKED
            self.parked[request_id] = seq
        else:
            self._release(seq)
            seq.status = Status.FINISHED
        return seq

    def resume_parked(self, request_id: str, token_ids: list[int]) -> Sequence | None:
        """A parked sequence whose tokens match continues on its kept KV, ahead of other waiting ones."""
        seq = self.parked.pop(request_id, None)
        if seq is None:
            return None
        if seq.token_ids != token_ids:
            self._release(seq)
            return None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        return seq

    def release_parked(self, request_id: str) -> None:
        seq = self.parked.pop(request_id, None)
        if seq is not None:
            self._release(seq)

    def drop_all_kv(self) -> None:
        """KV cache is about to be freed (sleep): everything in flight will be re-prefilled."""
        for seq in reversed(self.running):
            self._release(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self.running.clear()
        for seq in (*self.waiting, *self.parked.values()):
            self._release(seq)
        self.blocks.reset_prefix_cache()

    # ------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch:
        """Pick the next step's work; an empty batch means nothing can run (no unfinished requests)."""
        batch = ScheduledBatch()
        while True:
            self._schedule_decodes(batch)
            self._schedule_prefills(batch)
            if batch.seqs or batch.truncated or not self.has_unfinished():
                return batch
            # Nothing fits although work remains: partial prefills or idle KV hold the blocks.
            if self._free_idle_kv():
                continue
            if not self.running:
                return batch
            batch.preempted.append(self._preempt(self.running[-1]))

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1:
                continue  # preempted above as a victim, or still prefilling
            while seq.status is Status.RUNNING and not self._reserve(seq, 1):
                if not self._free_idle_kv():
                    if len(self.running) == 1:  # alone, and the whole pool is not enough: stop here
                        self.running.remove(seq)
                        self._finish(seq, "length")
                        batch.truncated.append(seq)
                    else:  # the newest unscheduled sequence (possibly seq itself) recomputes later
                        victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                        batch.preempted.append(self._preempt(victim))
            if seq.status is Status.RUNNING:
                self._offer_full_blocks(seq, 1)
                batch.add(seq, 1)
                scheduled.add(id(seq))

    def _free_idle_kv(self) -> bool:
        """Free KV that no running sequence is using: parked, or held by a resumed one still waiting."""
        if self.parked:
            self.release_parked(next(iter(self.parked)))
            return True
        for seq in self.waiting:
            if seq.block_table:
                self._release(seq)
                return True
        return False

    def _schedule_prefills(self, batch: ScheduledBatch) -> None:
        budget = self.max_prefill_tokens
        for seq in self.running:
            if budget <= 0:
                return
            if seq.num_uncomputed <= 1:
                continue  # decoding (scheduled above)
            n = min(seq.num_uncomputed, budget)
            if self._reserve(seq, n):
                self._offer_full_blocks(seq, n)
                batch.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_table  # a resumed parked sequence brings its own blocks
            if fresh:
                self._match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, n):
                if fresh:  # do not hold shared blocks while waiting
                    self._release(seq)
                return
            if fresh:
                self.num_prefix_hit_tokens += seq.num_cached_tokens
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._offer_full_blocks(seq, n)
            batch.add(seq, n)
            budget -= n

    # ------------------------------------------------------------ after the model step
    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, tuple[int, float]], version: int) -> list[Sequence]:
        """Advance computed counts, append sampled tokens (index in batch -> (token, logprob)), finish.

        Returns the sequences that finished in this step, including those truncated by capacity.
        """
        finished = list(batch.truncated)
        for i, seq in enumerate(batch.seqs):
            seq.num_computed_tokens = batch.starts[i] + batch.num_tokens[i]
            if seq.kv_version is None:  # versions only grow: the first KV written is the oldest
                seq.kv_version = version
            if i not in sampled:
                continue
            if seq.state_version is None or seq.kv_version < seq.state_version:
                seq.state_version = seq.kv_version
            token, logprob = sampled[i]
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            reason = self.stop_reason(seq)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def reserve_ahead(self, batch: ScheduledBatch, steps: int) -> bool:
        """Blocks for `steps` tokens of every sequence of a batch of one-token decodes (a burst, whose first step
        `schedule` reserved), all or none: False, and nothing taken, when the pool has too few free."""
        if not self.blocks.can_allocate(sum(self._blocks_needed(seq, steps) for seq in batch.seqs)):
            return False
        return all([self._reserve(seq, steps) for seq in batch.seqs])  # each fits: the total did

    def postprocess_burst(self, batch: ScheduledBatch, steps: list[dict[int, tuple[int, float]]],
                          version: int) -> list[Sequence]:
        """`postprocess` for each step of a burst in turn (`reserve_ahead`): after the first, the batch's sequences
        decode one token each, as `schedule` would have scheduled them (a burst ends at the step where one of them
        stops, and before the max_new_tokens of any)."""
        finished = self.postprocess(batch, steps[0], version)
        for sampled in steps[1:]:
            step, on = ScheduledBatch(), {}
            for i, seq in enumerate(batch.seqs):
                if seq.status is Status.RUNNING:
                    self._offer_full_blocks(seq, 1)
                    on[i] = len(step)
                    step.add(seq, 1)
            finished += self.postprocess(step, {on[i]: drawn for i, drawn in sampled.items() if i in on}, version)
        for seq in batch.seqs:  # a burst a stop ended early: the blocks reserved past it go back, as if never taken
            if seq.status is Status.RUNNING:
                keep = self.blocks.blocks_for(seq.num_computed_tokens)
                self.blocks.free(seq.block_table[keep:])
                del seq.block_table[keep:]
        return finished

    @staticmethod
    def stop_reason(seq: Sequence) -> str | None:
        if seq.num_output_tokens and seq.token_ids[-1] in seq.stop_ids:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_new_tokens:
            return "length"
        return None

    # ------------------------------------------------------------ blocks
    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """The blocks seq must still take to hold its next n tokens."""
        return max(0, self.blocks.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table))

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make sure seq has blocks for its next n tokens (check beside the allocation it guards)."""
        needed = self._blocks_needed(seq, n)
        if needed <= 0:
            return True
        if not self.blocks.can_allocate(needed):
            return False
        seq.block_table.extend(self.blocks.allocate(needed))
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        # The block holding the last token is never shared: that token must be computed for logits.
        blocks, keys = self.blocks.match_prefix(seq.token_ids, (seq.num_tokens - 1) // self.blocks.block_size)
        seq.block_table = blocks
        seq.block_keys = keys
        seq.key_epoch = self.blocks.epoch
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.blocks.block_size

    def _offer_full_blocks(self, seq: Sequence, n: int) -> None:
        """Offer the blocks that become full once this step's n tokens are written."""
        if seq.key_epoch != self.blocks.epoch:
            return  # KV computed partly under older weights: not shareable
        size = self.blocks.block_size
        full = (seq.num_computed_tokens + n) // size
        parent = seq.block_keys[-1] if seq.block_keys else chain_root(seq.key_epoch)
        for i in range(len(seq.block_keys), full):
            tokens = seq.token_ids[i * size:(i + 1) * size]
            parent = block_key(parent, tokens)
            self.blocks.register(seq.block_table[i], parent, tokens)
            seq.block_keys.append(parent)

    def _preempt(self, seq: Sequence) -> Sequence:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        return seq

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        seq.key_epoch = -1
        seq.kv_version = None
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
