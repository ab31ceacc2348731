"""The engine's local step scheduler (one DP rank): continuous batching over a KV block
budget, with chunked prefill, recompute preemption, the staggered-batch prefill gate and
stop handling. Pure: no I/O, no clock (``now`` is passed in).

One step is ``plan = schedule(gate)`` -> the model runner computes ``plan.chunks`` and
samples one token for every chunk with ``sample=True`` -> ``postprocess(plan, sampled,
now)`` returns the new tokens to emit. Decodes are kept as sequences (``plan.decode_seqs``)
and become ChunkInputs only when a model runner asks for ``plan.chunks``: the hot path
of a decode-heavy step (and of the simulator, which never asks) builds no objects.

Scheduling order per step, under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. **Decodes** of running sequences, one token each, in admission order. A decode that
   needs a new KV block when none is free preempts the most recently admitted running
   sequence (possibly itself) until the block fits.
2. **Prefill continuations** of running sequences whose prefill is not done (chunked
   prefill: a long prompt takes several steps).
3. **Admissions** from the waiting queue, FCFS (skipped in a step that preempted, so a
   victim is not readmitted into the same shortage). ``may_prefill(seq)`` is the
   staggered-batch gate: a sequence it refuses stays waiting (``seq.held``) and the scan
   moves past it; decodes never wait for the gate. A sequence is admitted only when the
   pool holds blocks for all its current tokens; those are reserved at admission, so a
   prefill, once started, never waits for blocks. FCFS: the first admissible sequence
   that does not fit stops admissions for this step.

**Preemption by recompute.** The victim's blocks are freed, ``num_computed_tokens`` goes
back to 0 and it returns to the *front* of the waiting queue. Its generated tokens are
kept: its next prefill covers prompt + generated, the token sampled at the end of that
prefill is the next new one, and ``streamed`` guarantees nothing is emitted twice. A
request resumed from another rank (``generated`` non-empty on arrival) is the same case.

**Never deadlocks.** ``add`` rejects (finish_reason ``"error"``, ``seq.error`` says why) a
sequence whose prompt + max_tokens exceeds ``max_model_len`` or the rank's whole KV pool
(or, without chunked prefill, the per-step token budget). Every admitted sequence can
therefore always be completed alone, and preemption always frees enough for the oldest.

**Stop handling.** A sampled token finishes the sequence when it is EOS (unless
``ignore_eos``; reason ``"stop"``), when it completes a stop string (``"stop"``; the token
is emitted, nothing after it is generated; the api-server trims the text from the stop
string on, see shared/stop.py), when it is one of ``stop_token_ids`` (``"stop"``), or when
max_tokens is reached (``"length"``). Before ``min_tokens`` tokens only max_tokens ends it
(the torch sampler also masks EOS and the stop tokens until then), and a stop string counts
only once the output is longer than ``min_tokens`` (vLLM's rule).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine_worker.batch import ChunkInput
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.sequence import Sequence, SeqStatus
from shared.tokenizer import EOS

RUNNING = SeqStatus.RUNNING
WAITING = SeqStatus.WAITING
FINISHED = SeqStatus.FINISHED


@dataclass(slots=True)
class StepPlan:
    """What one step computes on this rank: one token for each of ``decode_seqs`` (their
    last), then ``prefill_chunks``."""

    decode_seqs: list[Sequence] = field(default_factory=list)
    prefill_chunks: list[ChunkInput] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    max_context: int = 0         # largest context (start_pos + tokens) of any chunk
    decode_context: int = 0      # largest context among the decodes
    held: int = 0                # waiting sequences the gate held this step
    admitted: list[Sequence] = field(default_factory=list)   # admitted by this plan, in order
    dropped: list[str] = field(default_factory=list)         # chunks trimmed away entirely (token alignment)
    no_prefill_pending: bool = False   # nothing to prefill here: no prefill under way, none waiting
    _chunks: list[ChunkInput] | None = None

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def empty(self) -> bool:
        return not self.decode_seqs and not self.prefill_chunks

    @property
    def chunks(self) -> list[ChunkInput]:
        """Every chunk the model runner computes, decodes first (built on first use)."""
        if self._chunks is None:
            out = []
            for seq in self.decode_seqs:
                gen, p = seq.generated, seq.params
                out.append(ChunkInput(seq.id, [gen[-1]], len(seq.prompt) + len(gen) - 1, seq.block_table,
                                      True, p.temperature, p.top_p, p.seed, len(seq.prompt)))
            out.extend(self.prefill_chunks)
            self._chunks = out
        return self._chunks

    def set_prefill(self, chunks: list[ChunkInput]) -> None:
        """Replace the prefill chunks (token alignment trims them)."""
        self.prefill_chunks = chunks
        self._chunks = None
        self.max_context = max([self.decode_context, *(c.context_len for c in chunks)])


@dataclass(slots=True)
class Output:
    """New tokens of one sequence after a step. ``pos`` is the index of ``new_tokens[0]``
    among the sequence's generated tokens (Delta.pos)."""

    seq: Sequence
    new_tokens: list[int]
    pos: int
    finish_reason: str | None = None


class EngineScheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, chunked_prefill: bool = True) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if max_num_batched_tokens < max_num_seqs:
            # Otherwise the running set's decodes alone could exceed one step's budget.
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order (oldest first)
        self._seqs: dict[str, Sequence] = {}   # live (waiting + running) by id
        self.num_preemptions = 0               # total, for metrics

    # -- counters ----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_used(self) -> int:
        return self.bm.num_used_blocks

    @property
    def kv_total(self) -> int:
        return self.bm.num_total_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_blocked(self) -> bool:
        """The next waiting sequence cannot start for want of KV blocks: the rank admits
        nothing until running sequences free some (the dispatcher holds new work meanwhile)."""
        return bool(self.waiting) and not self.bm.can_allocate(self.waiting[0], self.waiting[0].num_tokens)

    def outstanding_tokens(self) -> int:
        """Prompt (re-)prefill tokens not yet computed + output tokens still to come."""
        total = 0
        for s in self.waiting:
            total += s.num_tokens + s.remaining_output
        for s in self.running:
            total += s.prefill_target - s.num_computed_tokens if s.is_prefilling else 0
            total += s.remaining_output
        return total

    def load(self) -> tuple[int, int]:
        """(outstanding_tokens(), prefill tokens not yet computed) in one pass."""
        total = pending = 0
        for s in self.waiting:
            n = len(s.generated)
            pending += len(s.prompt) + n
            total += s.params.max_tokens - n
        for s in self.running:
            if s.num_computed_tokens < s.prefill_target:
                pending += s.prefill_target - s.num_computed_tokens
            total += s.params.max_tokens - len(s.generated)
        return total + pending, pending

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # -- admission and removal ---------------------------------------------------------

    def check(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run on this rank, or None when it can."""
        p, mt = len(seq.prompt), seq.params.max_tokens
        total = p + mt
        if mt < 1:
            return f"max_tokens must be at least 1, got {mt}"
        if seq.num_tokens == 0:
            return "the prompt is empty"
        if total > self.max_model_len:
            return (f"prompt ({p} tokens) + max_tokens ({mt}) = {total} tokens exceeds the "
                    f"model's context length ({self.max_model_len} tokens)")
        if self.bm.blocks_for(total) > self.bm.num_blocks:
            return (f"prompt ({p} tokens) + max_tokens ({mt}) = {total} tokens exceeds this "
                    f"rank's KV cache ({self.bm.capacity_tokens} tokens)")
        if not self.chunked_prefill and total - 1 > self.max_num_batched_tokens:
            return (f"prompt ({p} tokens) + max_tokens ({mt}) needs a prefill of up to "
                    f"{total - 1} tokens, more than one step's budget "
                    f"({self.max_num_batched_tokens}) without chunked prefill")
        return None

    def add(self, seq: Sequence, now: float | None = None) -> Output | None:
        """Queue ``seq``. Returns None when queued (or when its id is already live: a
        redelivery is a no-op), or a finishing Output when it can never run (``"error"``)
        or a resumed request already has all its tokens (``"length"``)."""
        if seq.id in self._seqs:
            return None
        why = self.check(seq)
        if why is None and seq.remaining_output <= 0:
            self._set_finished(seq, "length", now)
            return Output(seq, [], seq.streamed, "length")
        if why is not None:
            seq.error = why
            self._set_finished(seq, "error", now)
            return Output(seq, [], seq.streamed, "error")
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.prefill_target = 0
        self.waiting.append(seq)
        self._seqs[seq.id] = seq
        return None

    def abort(self, seq_id: str, now: float | None = None) -> Sequence | None:
        """Remove a live sequence (client went away): frees its blocks. None if unknown."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._finish(seq, "abort", now)
        return seq

    # -- one step ----------------------------------------------------------------------

    def schedule(self, may_prefill: Callable[[Sequence], bool] | None = None) -> StepPlan:
        plan = StepPlan()
        chunks = plan.prefill_chunks
        dseqs = plan.decode_seqs
        budget = self.max_num_batched_tokens
        bm = self.bm
        run = self.running
        max_ctx = 0

        # 1. Decodes, oldest first; shortage preempts from the newest end. (The hot
        # path: one token, the last sampled one; a new block every block_size steps.)
        bs = bm.block_size
        i = 0
        decodes = 0
        prefilling = 0
        while i < len(run) and decodes < budget:
            seq = run[i]
            if seq.num_computed_tokens < seq.prefill_target:
                prefilling += 1
                i += 1
                continue
            n = len(seq.prompt) + len(seq.generated)
            if n > len(seq.block_table) * bs:
                while not bm.can_allocate(seq, n):
                    victim = run.pop()
                    self._preempt(victim)
                    plan.preempted.append(victim.id)
                    if victim is seq:
                        break
                if seq.status is not RUNNING:
                    break                  # it was the newest: nothing after it
                bm.allocate(seq, n)
            dseqs.append(seq)
            decodes += 1
            if n > max_ctx:
                max_ctx = n
            i += 1
        plan.decode_context = max_ctx
        plan.decode_tokens = decodes
        budget -= decodes
        # the scan saw every running sequence and none is prefilling, and nobody waits
        plan.no_prefill_pending = not prefilling and i >= len(run) and not self.waiting

        # 2. Continue prefills already under way (their blocks are reserved). The decode
        # scan counted them, unless it stopped early.
        for seq in (run if prefilling or i < len(run) else ()):
            if budget <= 0:
                break
            if not seq.is_prefilling:
                continue
            start = seq.num_computed_tokens
            end = min(seq.prefill_target, start + budget)
            chunks.append(self._chunk(seq, start, end, end == seq.num_tokens))
            plan.prefill_tokens += end - start
            budget -= end - start
            if end > max_ctx:
                max_ctx = end

        # 3. Admit waiting sequences, FCFS, through the gate.
        if not plan.preempted and budget > 0 and self.waiting and len(run) < self.max_num_seqs:
            wq = self.waiting
            skipped: list[Sequence] = []
            while wq and budget > 0 and len(run) < self.max_num_seqs:
                seq = wq[0]
                if may_prefill is not None and not may_prefill(seq):
                    seq.held = True
                    skipped.append(wq.popleft())
                    continue
                seq.held = False
                n = seq.num_tokens
                if not self.chunked_prefill and n > budget:
                    break
                if not bm.can_allocate(seq, n):
                    break
                wq.popleft()
                bm.allocate(seq, n)
                seq.status = RUNNING
                seq.num_computed_tokens = 0
                seq.prefill_target = n
                run.append(seq)
                plan.admitted.append(seq)
                end = min(n, budget)
                chunks.append(self._chunk(seq, 0, end, end == n))
                plan.prefill_tokens += end
                budget -= end
                if end > max_ctx:
                    max_ctx = end
            if skipped:
                wq.extendleft(reversed(skipped))
            plan.held = len(skipped)

        plan.max_context = max_ctx
        return plan

    def postprocess(self, plan: StepPlan, sampled: dict[str, int], now: float,
                    stream: bool = True) -> list[Output]:
        """Apply a computed step: advance every chunk, append sampled tokens, finish
        sequences (EOS, stop string, max_tokens) and free their blocks. Chunks of
        sequences aborted since ``schedule`` are ignored. ``stream=False`` (a runner that
        only needs first tokens and finishes, as the simulator) skips the Output of a
        decode that goes on: the next Output of that sequence carries its tokens."""
        outs: list[Output] = []
        finished = False
        reason_of = self._finish_reason
        for seq in plan.decode_seqs:          # the hot path: one token each
            if seq.status is not RUNNING:      # aborted since schedule
                continue
            gen = seq.generated
            seq.num_computed_tokens = len(seq.prompt) + len(gen)
            tok = sampled.get(seq.id)
            if tok is None:
                raise KeyError(f"the model runner returned no token for {seq.id!r}")
            gen.append(tok)
            params = seq.params
            n = len(gen)
            if tok != EOS and seq.stop_checker is None and n < params.max_tokens and not params.stop_token_ids:
                if not stream:
                    continue
                reason = None                  # the common case, without a call
            else:
                reason = reason_of(seq, tok)
            pos = seq.streamed
            outs.append(Output(seq, [tok] if pos == n - 1 else gen[pos:], pos, reason))
            seq.streamed = n
            if reason is not None:
                self._finish(seq, reason, now)
                finished = True
        seqs = self._seqs
        for ch in plan.prefill_chunks:
            seq = seqs.get(ch.seq_id)
            if seq is None or seq.status is not RUNNING:
                continue
            seq.num_computed_tokens = ch.start_pos + len(ch.token_ids)
            if not ch.sample:
                continue
            tok = sampled.get(seq.id)
            if tok is None:
                raise KeyError(f"the model runner returned no token for {seq.id!r}")
            gen = seq.generated
            gen.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = reason_of(seq, tok)
            pos = seq.streamed
            outs.append(Output(seq, gen[pos:], pos, reason))
            seq.streamed = len(gen)
            if reason is not None:
                self._finish(seq, reason, now)
                finished = True
        if finished:
            self.running = [s for s in self.running if s.status is RUNNING]
        return outs

    @staticmethod
    def _finish_reason(seq: Sequence, tok: int) -> str | None:
        """Why ``seq`` ends with the token it just got (None: it goes on)."""
        params = seq.params
        n = len(seq.generated)
        early = n < params.min_tokens     # nothing but max_tokens ends it yet
        if tok == EOS and not params.ignore_eos and not early:
            return "stop"
        # The checker sees every token (so one begun within min_tokens is found), and a stop
        # string counts once the output is longer than min_tokens, as in vLLM: one completed
        # by token min_tokens itself does not (the api-server cuts alike, choice.feed).
        if seq.stop_checker is not None and seq.stop_checker.feed(tok) and n > params.min_tokens:
            return "stop"
        if params.stop_token_ids and tok in params.stop_token_ids and not early:
            return "stop"
        if n >= params.max_tokens:   # add() keeps prompt+max_tokens <= max_model_len
            return "length"
        return None

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Undo this step's admission of ``seqs`` (their chunks were trimmed away): free
        their blocks and put them back at the front of the queue, in order, so a budget
        that caps a prefill to nothing never holds KV for it."""
        for seq in reversed(seqs):
            if seq.status is not RUNNING or seq.num_computed_tokens:
                continue
            self.running.remove(seq)
            self.bm.free(seq)
            seq.status = WAITING
            seq.prefill_target = 0
            self.waiting.appendleft(seq)

    # -- internals ---------------------------------------------------------------------

    def _chunk(self, seq: Sequence, start: int, end: int, sample: bool) -> ChunkInput:
        p = seq.params
        return ChunkInput(seq_id=seq.id, token_ids=seq.token_slice(start, end), start_pos=start,
                          block_table=seq.block_table, sample=sample, temperature=p.temperature,
                          top_p=p.top_p, seed=p.seed, prompt_len=len(seq.prompt))

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        seq.prefill_target = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str, now: float | None) -> None:
        self.bm.free(seq)
        self._seqs.pop(seq.id, None)
        self._set_finished(seq, reason, now)

    @staticmethod
    def _set_finished(seq: Sequence, reason: str, now: float | None) -> None:
        seq.status = FINISHED
        seq.finish_reason = reason
        if now is not None:
            seq.finish_time = now
