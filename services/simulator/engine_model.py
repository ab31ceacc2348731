"""The DP ranks of one engine group, modeled compactly and run in lockstep.

Per rank: continuous batching with a step token budget (``max_num_batched_tokens``), a
sequence limit (``max_num_seqs``), chunked prefill and a KV budget in blocks. The group
runs in lockstep: every step lasts ``CostModel.step_ms(max over ranks of scheduled
tokens, max over ranks of KV context read)``; a rank with nothing to compute while
another rank has work runs an idle (dummy) forward; when no rank has work the group
pauses (the caller wakes it when work is delivered or a gate times out).

Scheduling on a rank, each step (vLLM V1 order):

1. every decoding sequence gets one token;
2. sequences in the middle of their prefill get the next chunk, oldest first, from the
   remaining budget;
3. waiting requests are admitted FCFS while there is budget, a free sequence slot and KV
   room, each getting a first chunk; the head of the queue blocks the rest (as vLLM).

KV: a request is admitted only when the rank can reserve blocks for its whole prompt plus
output (``ceil((prompt+output)/block_size)``), released when it finishes. That is
TensorRT-LLM's GUARANTEED_NO_EVICT capacity policy: no preemption, so no recompute to
model. ``kv_used`` in the stats is the reserved blocks.

Context read (the cost model's ``ctx``): per scheduled chunk its ``context_len`` (start +
length; for a decode, the sequence length including the new token), summed over the rank.

Sequences live in flat numpy slot arrays (``ranks × max_num_seqs``), so a decode step of
thousands of sequences is a handful of vector operations; only prefill, admission and
completions run per-request Python.

Per-step token alignment (``budget=BudgetConfig``, lockstep's ``aligned`` policies): after
each rank's unconstrained plan, the group computes one shared token budget ``T`` from every
rank's (decode tokens, planned tokens, deadline rate) with
services/engine_worker/step_budget.py, the code the live worker runs, and each rank whose
plan exceeds ``T`` re-plans its prefill with ``T - decode`` tokens. Off (None) for every
baseline.

Gates (engine side, shared by all ranks because the ranks exchange gate state through the
step's collective; in the simulator it is one object):

* :class:`BatchGate` (staggered batches: lockstep's and FastDeploy's): a request tagged
  with a batch is held until the whole batch has arrived on every rank
  (``batch_counts[r]`` = requests of the batch for rank id ``r``, see
  shared/policy/staggered.py) or until the batch's timeout, counted from the first
  boundary at which any rank held part of it: one deadline for all ranks. Decodes never
  wait.
* :class:`AdpGate` (TensorRT-LLM ADP Balance): context (prefill) work is held on every
  rank unless every rank has some (and a free slot); holding stops after ``timeout_iters``
  steps or when some rank has no generation work; once all ranks have context it may still
  wait up to ``batching_wait_iters`` steps to accumulate more while every rank decodes.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from shared.cost_model import CostModel
from shared.policy.base import Assignment
from shared.stats import RankStats
from services.engine_worker.step_budget import BudgetConfig, must_tokens, shared_budget


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    num_kv_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 4096

    def pooled(self, ranks: int) -> "EngineConfig":
        """One rank with the capacity of ``ranks`` (the perfectly balanced ideal)."""
        return EngineConfig(self.max_num_batched_tokens * ranks, self.max_num_seqs * ranks,
                            self.num_kv_blocks * ranks, self.block_size, self.max_model_len)


class BatchGate:
    """Hold tagged prefills until the batch is complete on every rank or times out."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # batch id -> [missing requests, deadline or None, [(rank, req), ...]]
        self._open: dict[str, list] = {}
        self.released_full = 0
        self.released_timeout = 0

    def hold(self, rank: int, req: int, asg: Assignment) -> None:
        b = self._open.get(asg.batch)
        if b is None:
            total = sum(asg.batch_counts) if asg.batch_counts else 1
            b = self._open[asg.batch] = [total, None, []]
        b[0] -= 1
        b[2].append((rank, req))

    def release(self, now: float) -> list[tuple[int, int]]:
        if not self._open:
            return []
        out: list[tuple[int, int]] = []
        done = []
        for bid, b in self._open.items():
            if b[1] is None:
                b[1] = now + self.timeout_s     # first boundary that sees the batch
            if b[0] <= 0:
                self.released_full += 1
            elif now >= b[1]:
                self.released_timeout += 1
            else:
                continue
            out.extend(b[2])
            done.append(bid)
        for bid in done:                         # bookkeeping pruned on release
            del self._open[bid]
        return out

    def next_deadline(self) -> float | None:
        """Earliest batch timeout (batches not yet seen at a boundary get theirs at the
        next :meth:`release`, which the caller runs on every wake-up)."""
        ds = [b[1] for b in self._open.values() if b[1] is not None]
        return min(ds) if ds else None

    @property
    def open_batches(self) -> int:
        return len(self._open)


class AdpGate:
    """TensorRT-LLM ADP Balance (``attention_dp_config.enable_balance``)."""

    def __init__(self, timeout_iters: int = 50, batching_wait_iters: int = 10) -> None:
        self.timeout_iters = timeout_iters
        self.batching_wait_iters = batching_wait_iters
        self._waiting = 0
        self._batching = 0
        self.held_steps = 0

    def allow(self, has_ctx: np.ndarray, n_gen: np.ndarray, max_seqs: int) -> bool:
        if not has_ctx.any():
            return True
        all_gen = bool((n_gen > 0).all())
        if bool((n_gen < max_seqs).all()) and bool(has_ctx.all()):
            self._waiting = 0
            if all_gen:
                if self._batching < self.batching_wait_iters:
                    self._batching += 1
                    self.held_steps += 1
                    return False
                self._batching = 0
            return True
        self._waiting += 1
        if self._waiting >= self.timeout_iters or not all_gen:
            self._waiting = 0
            return True
        self.held_steps += 1
        return False


@dataclass(slots=True)
class StepOut:
    dur_s: float
    scheduled: np.ndarray       # per-rank tokens (int64)
    prefill: np.ndarray
    decode: np.ndarray          # per-rank decode tokens
    finished: list[int]         # request indices finished at the end of the step
    firsts: list[int]           # request indices that got their first token


class EngineGroup:
    """All DP ranks of one group. Request ``i`` is described by ``prompt[i]``/``output[i]``."""

    def __init__(self, ranks: int, cfg: EngineConfig, cost: CostModel, prompt: np.ndarray,
                 output: np.ndarray, *, gate: BatchGate | AdpGate | None = None,
                 cost_divisor: int = 1, budget: BudgetConfig | None = None) -> None:
        self.R, self.S = ranks, cfg.max_num_seqs
        self.cfg, self.cost = cfg, cost
        self.B = cfg.max_num_batched_tokens
        self.K = cfg.num_kv_blocks
        self.bs = cfg.block_size
        self.div = cost_divisor
        self.prompt = prompt.tolist()
        self.output = output.tolist()
        self.need = (-(-(prompt + output) // cfg.block_size)).tolist()
        n_slots = ranks * self.S
        self.s_req = np.full(n_slots, -1, dtype=np.int64)
        self.s_ctx = np.zeros(n_slots, dtype=np.int64)
        self.s_left = np.zeros(n_slots, dtype=np.int64)
        self.s_dec = np.zeros(n_slots, dtype=bool)
        self.s_kv = [0] * n_slots
        self.free = [list(range((r + 1) * self.S - 1, r * self.S - 1, -1)) for r in range(ranks)]
        self.waiting: list[deque[int]] = [deque() for _ in range(ranks)]
        self.prefilling: list[list[int]] = [[] for _ in range(ranks)]
        self.kv_free = [self.K] * ranks
        self.held = [0] * ranks
        self.outstanding = np.zeros(ranks, dtype=np.int64)
        self.waiting_prompt = [0] * ranks
        self.finished_step = [0] * ranks
        self.recv: list[dict[str, int]] = [{} for _ in range(ranks)]
        self.gate = gate
        self.budget = budget                 # per-step token alignment (step_budget.py)
        self.last_budget = 0
        self.last_dur_ms = cost.fixed_ms       # previous step's duration (the budget's step estimate)
        self.enq_t = [0.0] * len(self.prompt)   # when a request became schedulable on its rank
        self.batch_gate = gate if isinstance(gate, BatchGate) else None
        self.adp_gate = gate if isinstance(gate, AdpGate) else None
        self.first_t = np.full(len(self.prompt), np.nan)
        self.finish_t = np.full(len(self.prompt), np.nan)
        self.rank_of = np.full(len(self.prompt), -1, dtype=np.int64)
        self.done = 0
        self.delivered = 0

    # ------------------------------------------------------------------ inputs
    def ingest(self, r: int, i: int, now: float = 0.0) -> None:
        """Request ``i`` is in rank ``r``'s waiting queue (no gate)."""
        self.waiting[r].append(i)
        self.enq_t[i] = now
        self.outstanding[r] += self.prompt[i] + self.output[i]
        self.waiting_prompt[r] += self.prompt[i]
        self.rank_of[i] = r
        self.delivered += 1

    def deliver(self, asg: Assignment, i: int, now: float = 0.0) -> None:
        """An assignment reached rank ``asg.rank``'s inbox (read at the next boundary)."""
        r = asg.rank
        if asg.dispatcher:
            rc = self.recv[r]
            if asg.seq > rc.get(asg.dispatcher, 0):
                rc[asg.dispatcher] = asg.seq
        if self.batch_gate is not None and asg.batch is not None:
            self.batch_gate.hold(r, i, asg)
            self.held[r] += 1
            self.outstanding[r] += self.prompt[i] + self.output[i]
            self.waiting_prompt[r] += self.prompt[i]
            self.rank_of[i] = r
            self.delivered += 1
        else:
            self.ingest(r, i, now)

    def next_deadline(self) -> float | None:
        return self.batch_gate.next_deadline() if self.batch_gate is not None else None

    def has_queued(self) -> bool:
        return any(self.waiting) or any(self.held)

    # ------------------------------------------------------------------ the step
    def step(self, now: float) -> StepOut | None:
        """Schedule and run one lockstep step starting at ``now``; None = nothing to run
        on any rank (the group pauses)."""
        R, S = self.R, self.S
        if self.batch_gate is not None:
            for r, i in self.batch_gate.release(now):
                self.held[r] -= 1
                self.waiting[r].append(i)
                self.enq_t[i] = now
        dec = self.s_dec
        n_dec = dec.reshape(R, S).sum(axis=1)
        pf_tok = np.zeros(R, dtype=np.int64)
        pf_ctx = np.zeros(R, dtype=np.int64)
        plans = []
        prompt, need = self.prompt, self.need
        s_ctx, s_req = self.s_ctx, self.s_req
        B = self.B
        def plan_rank(r: int, budget: int):
            wq, pq = self.waiting[r], self.prefilling[r]
            tok = ctxsum = 0
            cont = []
            for s in pq:
                if budget <= 0:
                    break
                done = int(s_ctx[s])
                c = min(prompt[int(s_req[s])] - done, budget)
                cont.append((s, c))
                budget -= c
                tok += c
                ctxsum += done + c
            new = []
            if budget > 0 and wq:
                free_n, kvf = len(self.free[r]), self.kv_free[r]
                for i in wq:
                    if budget <= 0 or free_n == 0 or need[i] > kvf:
                        break
                    c = min(prompt[i], budget)
                    new.append((i, c))
                    budget -= c
                    kvf -= need[i]
                    free_n -= 1
                    tok += c
                    ctxsum += c
            return cont, new, tok, ctxsum

        busy = [r for r in range(R) if self.waiting[r] or self.prefilling[r]]
        full = {r: plan_rank(r, B - int(n_dec[r])) for r in busy}
        if self.budget is not None and full:
            dl = n_dec.tolist()
            tokens = list(dl)
            must = list(dl)
            now_ms = now * 1000.0
            step_ms = self.last_dur_ms
            enq = self.enq_t
            for r, (_, _, tok, _) in full.items():
                tokens[r] += tok
                if tok:
                    pend = [(enq[int(s_req[s])] * 1000.0, prompt[int(s_req[s])] - int(s_ctx[s]))
                            for s in self.prefilling[r]]
                    if len(pend) < 64:
                        pend.extend((enq[i] * 1000.0, prompt[i]) for i in itertools.islice(self.waiting[r], 64))
                    must[r] = must_tokens(dl[r], pend, now_ms, step_ms, self.budget)
            T = shared_budget(dl, tokens, must, self.budget)
            self.last_budget = T
            for r in busy:
                if tokens[r] > T:
                    full[r] = plan_rank(r, T - dl[r])
        for r in busy:
            cont, new, tok, ctxsum = full[r]
            if tok:
                plans.append((r, cont, new))
                pf_tok[r] = tok
                pf_ctx[r] = ctxsum
        if plans and self.adp_gate is not None:
            if not self.adp_gate.allow(pf_tok > 0, n_dec, S):
                plans = []
                pf_tok[:] = 0
                pf_ctx[:] = 0
        sched = n_dec + pf_tok
        mx = int(sched.max())
        if mx <= 0:
            return None
        dec_ctx = np.where(dec, s_ctx + 1, 0).reshape(R, S).sum(axis=1)
        max_ctx = int((dec_ctx + pf_ctx).max())
        div = self.div
        dur = self.cost.step_ms(mx / div if div > 1 else mx, max_ctx / div if div > 1 else max_ctx) / 1000.0
        t_end = now + dur
        self.last_dur_ms = dur * 1000.0

        finished: list[int] = []
        firsts: list[int] = []
        fin_step = self.finished_step
        for r in range(R):
            fin_step[r] = 0
        # decodes: one token each
        if mx and n_dec.any():
            s_ctx += dec
            self.s_left -= dec
            for s in np.flatnonzero(dec & (self.s_left == 0)).tolist():
                finished.append(self._finish(s, t_end))
        # prefill chunks
        out = self.outstanding
        out -= sched
        for r, cont, new in plans:
            completed = False
            for s, c in cont:
                s_ctx[s] += c
                i = int(s_req[s])
                if s_ctx[s] >= prompt[i]:
                    completed = True
                    self._first(s, i, r, t_end, finished, firsts)
            if completed:
                self.prefilling[r] = [s for s in self.prefilling[r] if not self.s_dec[s] and s_req[s] >= 0]
            wq = self.waiting[r]
            for i, c in new:
                wq.popleft()
                s = self.free[r].pop()
                n = need[i]
                self.kv_free[r] -= n
                self.s_kv[s] = n
                self.waiting_prompt[r] -= prompt[i]
                s_req[s] = i
                s_ctx[s] = c
                self.s_left[s] = self.output[i]
                if c >= prompt[i]:
                    self._first(s, i, r, t_end, finished, firsts)
                else:
                    self.prefilling[r].append(s)
        return StepOut(dur, sched, pf_tok, n_dec, finished, firsts)

    def _first(self, s: int, i: int, r: int, t: float, finished: list[int], firsts: list[int]) -> None:
        self.first_t[i] = t
        firsts.append(i)
        self.outstanding[r] -= 1
        self.s_left[s] -= 1
        if self.s_left[s] <= 0:
            finished.append(self._finish(s, t))
        else:
            self.s_dec[s] = True

    def _finish(self, s: int, t: float) -> int:
        i = int(self.s_req[s])
        r = s // self.S
        self.finish_t[i] = t
        self.kv_free[r] += self.s_kv[s]
        self.s_kv[s] = 0
        self.s_req[s] = -1
        self.s_ctx[s] = 0
        self.s_left[s] = 0
        self.s_dec[s] = False
        self.free[r].append(s)
        self.finished_step[r] += 1
        self.done += 1
        return i

    # ------------------------------------------------------------------ stats
    def rank_stats(self, wave: int, step: int, t: float, out: StepOut, with_tokens: bool = False) -> list[RankStats]:
        """Each rank's report for the step that just ended at ``t``."""
        R, S = self.R, self.S
        dur_ms = out.dur_s * 1000.0
        sched = out.scheduled.tolist()
        pf = out.prefill.tolist()
        dc = out.decode.tolist()
        outst = self.outstanding.tolist()
        any_work = max(sched) > 0
        tokens = self.s_ctx.reshape(R, S).sum(axis=1).tolist() if with_tokens else None
        stats = []
        for r in range(R):
            waiting = len(self.waiting[r]) + self.held[r]
            st = RankStats(
                r, wave, step, waiting, S - len(self.free[r]), sched[r], pf[r], dc[r],
                self.K - self.kv_free[r], self.K, outst[r], any_work and sched[r] == 0,
                dur_ms, t, self.finished_step[r], self.held[r], dict(self.recv[r]),
                {"tokens": tokens[r] + self.waiting_prompt[r]} if with_tokens else {},
            )
            stats.append(st)
        return stats
