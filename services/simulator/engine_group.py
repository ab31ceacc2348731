"""The DP ranks of one engine group in the simulator: the engine's own code on a virtual clock.

Every rank is the object the live engine-worker runs (services/engine_worker/rank_step.py:
the ``EngineScheduler`` with its paged KV blocks, chunked prefill and recompute preemption,
the staggered-batch ``BatchGate``, per-step token alignment). What the simulator adds is
only what a real deployment has outside that code:

* the collective: every rank's row is handed to every rank (``group_view``);
* the model: :class:`SimModel` samples a token for every chunk that asks for one, and the
  end-of-sequence token when the request reaches its true output length (the length the
  client did not know: requests carry only the client's ``max_tokens`` cap);
* the device: a step lasts ``CostModel.step_ms`` of the busiest rank's tokens and context
  (``cost_divisor`` spreads one pooled rank's tokens over R, for the ideal run; its longest
  context is not divided: a sequence's attention runs on one rank, in any placement);
* peers' engine-side gates (``group_gate``, services/simulator/peer_gates.py), consulted
  before the ranks schedule: when one says no, no rank starts a new prefill this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.cost_model import CostModel
from shared.messages import SamplingParams
from shared.policy.base import Assignment
from shared.stats import RankStats
from shared.tokenizer import EOS
from services.engine_worker.batch_gate import BatchGate
from services.engine_worker.block_manager import BlockManager
from services.engine_worker.engine_scheduler import EngineScheduler
from services.engine_worker.step_view import Action
from services.engine_worker.rank_step import RankStep, group_view
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_budget import BudgetConfig

NOT_EOS = 32   # any token but EOS


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Per-rank engine limits (EngineSettings' fields of the same names)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    num_kv_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 4096

    def pooled(self, ranks: int) -> "EngineConfig":
        """One rank with the capacity of ``ranks`` (the perfectly balanced ideal)."""
        return EngineConfig(self.max_num_batched_tokens * ranks, self.max_num_seqs * ranks,
                            self.num_kv_blocks * ranks, self.block_size, self.max_model_len)


@dataclass(slots=True)
class StepOut:
    dur_s: float
    scheduled: np.ndarray       # per-rank tokens computed this step
    prefill: np.ndarray
    decode: np.ndarray
    idle: np.ndarray            # per-rank: ran a dummy forward
    finished: list[int]         # request indices finished at the end of the step
    firsts: list[int]           # request indices that got their first token


class SimModel:
    """The simulator's model runner: one token per sampling chunk, EOS at the true length."""

    def __init__(self, true_output: dict[str, int]) -> None:
        self.true_output = true_output

    def run(self, plan: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        true_output = self.true_output
        for seq in plan.decode_seqs:            # generating token number len(generated)
            sid = seq.id
            out[sid] = EOS if len(seq.generated) + 1 >= true_output[sid] else NOT_EOS
        for ch in plan.prefill_chunks:
            if ch.sample:
                # index of the token being generated = context_len - prompt_len
                pos = ch.start_pos + len(ch.token_ids) - ch.prompt_len
                out[ch.seq_id] = EOS if pos + 1 >= true_output[ch.seq_id] else NOT_EOS
        return out


class EngineGroup:
    """All DP ranks of one group. Request ``i`` has ``prompt[i]`` tokens, the client's cap
    ``max_tokens[i]`` and (unknown to every policy) ``output[i]`` tokens to generate."""

    def __init__(self, ranks: int, cfg: EngineConfig, cost: CostModel, prompt: np.ndarray,
                 output: np.ndarray, max_tokens: np.ndarray, *, gate_timeout_s: float = 0.1,
                 budget: BudgetConfig | None = None, group_gate: Any = None,
                 cost_divisor: int = 1, report_outstanding: bool = True,
                 report_tokens: bool = False) -> None:
        self.R = ranks
        self.cfg, self.cost = cfg, cost
        self.div = cost_divisor
        self.ranks = [RankStep(r, EngineScheduler(BlockManager(cfg.num_kv_blocks, cfg.block_size),
                                                  cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                                  cfg.max_model_len),
                               BatchGate(rank=r, timeout_s=gate_timeout_s), budget)
                      for r in range(ranks)]
        self.prompt = prompt.tolist()
        self.output = output.tolist()
        self.cap = max_tokens.tolist()
        self.true_output: dict[str, int] = {}
        self.model = SimModel(self.true_output)
        self.group_gate = group_gate
        self.report_outstanding = report_outstanding
        self.report_tokens = report_tokens
        self.inbox: list[list[tuple[int, Assignment | None]]] = [[] for _ in range(ranks)]
        self.recv: list[dict[str, int]] = [{} for _ in range(ranks)]
        n = len(self.prompt)
        self.first_t = np.full(n, np.nan)
        self.finish_t = np.full(n, np.nan)
        self.generated = np.zeros(n, dtype=np.int64)
        self.rank_of = np.full(n, -1, dtype=np.int64)
        self.errors = 0
        self.rejected_new: list[int] = []
        self.done = 0
        self.delivered = 0
        self.holds = 0

    # ------------------------------------------------------------------ inputs
    def deliver(self, asg: Assignment | None, i: int, r: int | None = None) -> None:
        """Request ``i`` reached a rank's inbox; the rank reads it at its next boundary."""
        r = asg.rank if asg is not None else r
        self.inbox[r].append((i, asg))
        self.delivered += 1

    def _ingest(self, now: float) -> list[int]:
        """Every rank reads its inbox (the live worker's ``_ingest``); returns rejections."""
        rejected = []
        for r, box in enumerate(self.inbox):
            if not box:
                continue
            rs = self.ranks[r]
            recv = self.recv[r]
            for i, asg in box:
                sid = str(i)
                batch = counts = None
                if asg is not None:
                    if asg.dispatcher and asg.seq > recv.get(asg.dispatcher, 0):
                        recv[asg.dispatcher] = asg.seq
                    batch, counts = asg.batch, (list(asg.batch_counts) if asg.batch_counts else None)
                seq = Sequence(sid, [0] * self.prompt[i], SamplingParams(max_tokens=self.cap[i]),
                               arrival=now, batch=batch, batch_counts=counts)
                self.true_output[sid] = self.output[i]
                self.rank_of[i] = r
                if rs.core.add(seq, now) is not None:       # can never run here
                    rejected.append(i)
                    self.true_output.pop(sid, None)
                else:
                    rs.arrived(seq, now)
            box.clear()
        # a request no rank can run ends with an error: counted as done (the run ends) but
        # never as completed (finish_t stays NaN), and its dispatcher hears that it ended
        self.errors += len(rejected)
        self.done += len(rejected)
        self.rejected_new.extend(rejected)
        return rejected

    def take_rejected(self) -> list[int]:
        """The requests rejected since the last call (to tell their dispatchers)."""
        out, self.rejected_new = self.rejected_new, []
        return out

    # ------------------------------------------------------------------ peers' gates / binding
    def gate_view(self, now: float) -> Any:
        from services.simulator.peer_gates import GateView
        has_ctx, n_gen, n_run, n_wait, kv = [], [], [], [], []
        S = self.cfg.max_num_seqs
        for rs in self.ranks:
            core = rs.core
            gen = sum(1 for q in core.running if not q.is_prefilling)
            head = core.waiting[0] if core.waiting else None
            has_ctx.append(head is not None and len(core.running) < S
                           and core.bm.can_allocate(head, head.num_tokens))
            n_gen.append(gen)
            n_run.append(len(core.running))
            n_wait.append(len(core.waiting))
            kv.append(core.bm.usage)
        return GateView(now=now, has_ctx=has_ctx, n_gen=n_gen, n_running=n_run, n_waiting=n_wait,
                        max_num_seqs=S, kv_usage=kv)

    def loads(self) -> list[Any]:
        """Exact per-rank load, for a dispatcher inside the engine (late binding)."""
        from services.simulator.peer_gates import RankLoad
        out = []
        for r, rs in enumerate(self.ranks):
            core = rs.core
            ptoks = sum(len(q.prompt) for q in core.waiting) + sum(len(q.prompt) for q in core.running)
            out.append(RankLoad(rank=r, num_waiting=core.num_waiting + len(self.inbox[r]),
                                num_running=core.num_running, active_prompt_tokens=ptoks,
                                max_num_seqs=self.cfg.max_num_seqs,
                                kv_free_tokens=core.bm.num_free_blocks * core.bm.block_size))
        return out

    # ------------------------------------------------------------------ the step
    def step(self, now: float) -> StepOut | Action:
        """One lockstep step starting at ``now``: a StepOut, or ``Action.PAUSE`` (no rank has
        work) / ``Action.HOLD`` (all work is held by the batch gate: no forward)."""
        self._ingest(now)
        while True:
            admit = True
            if self.group_gate is not None and any(rs.core.waiting for rs in self.ranks):
                admit = self.group_gate.allow(self.gate_view(now))
            plans, rows = [], []
            for rs in self.ranks:
                plan, row = rs.plan(now, False, admit)
                plans.append(plan)
                rows.append(row)
            view = group_view(rows)
            actions = []
            released = 0
            for rs, plan in zip(self.ranks, plans):
                a, rel = rs.decide(plan, view, now)
                actions.append(a)
                released += rel
            a0 = actions[0]
            if a0 is Action.PAUSE:
                return a0
            if a0 is Action.HOLD:
                self.holds += 1
                if released:       # the exchange released a batch: plan again at once (as the worker)
                    continue
                return a0
            break
        mx = view.max_tokens
        max_ctx = view.max_ctx
        div = self.div
        mean = view.mean_tokens
        dur = self.cost.step_ms(mx / div if div > 1 else mx, max_ctx, mean / div if div > 1 else mean) / 1000.0
        t_end = now + dur
        for rs in self.ranks:
            rs.note_step(dur * 1000.0)
        R = self.R
        sched = np.zeros(R, dtype=np.int64)
        pf = np.zeros(R, dtype=np.int64)
        dec = np.zeros(R, dtype=np.int64)
        idle = np.zeros(R, dtype=bool)
        finished: list[int] = []
        firsts: list[int] = []
        model = self.model
        for r, (rs, plan, a) in enumerate(zip(self.ranks, plans, actions)):
            if a is not Action.RUN:
                idle[r] = a is Action.IDLE
                continue
            sched[r] = plan.num_tokens
            pf[r] = plan.prefill_tokens
            dec[r] = plan.decode_tokens
            outs = rs.core.postprocess(plan, model.run(plan), t_end, stream=False)
            for o in outs:
                if o.pos == 0 and o.new_tokens:
                    firsts.append(int(o.seq.id))
                if o.finish_reason is not None:
                    sid = o.seq.id
                    i = int(sid)
                    finished.append(i)
                    self.generated[i] = len(o.seq.generated)
                    self.true_output.pop(sid, None)
                    rs.forget(sid)
        for i in firsts:
            if self.first_t[i] != self.first_t[i]:   # NaN: the first token (a preempted one keeps its first)
                self.first_t[i] = t_end
        for i in finished:
            self.finish_t[i] = t_end
        self.done += len(finished)
        return StepOut(dur, sched, pf, dec, idle, finished, firsts)

    # ------------------------------------------------------------------ stats
    def rank_stats(self, wave: int, step: int, t: float, out: StepOut) -> list[RankStats]:
        """Each rank's report for the step that just ended at ``t`` (as the worker's)."""
        dur_ms = out.dur_s * 1000.0
        sched, pf, dc, idle = out.scheduled.tolist(), out.prefill.tolist(), out.decode.tolist(), out.idle.tolist()
        stats = []
        for r, rs in enumerate(self.ranks):
            core = rs.core
            extra: dict[str, Any] = {}
            if self.report_tokens:   # SGLang's token load: KV held + prompt tokens waiting
                extra["tokens"] = (sum(q.num_computed_tokens for q in core.running)
                                   + sum(q.num_tokens for q in core.waiting))
            outstanding, pending = core.load() if self.report_outstanding else (0, 0)
            stats.append(RankStats(
                r, wave, step, core.num_waiting, core.num_running, sched[r], pf[r], dc[r],
                core.kv_used, core.kv_total, outstanding, idle[r],
                dur_ms, t, 0, sum(1 for q in core.waiting if q.held), dict(self.recv[r]), extra, pending,
                core.kv_blocked()))
        return stats

    @property
    def preemptions(self) -> int:
        return sum(rs.core.num_preemptions for rs in self.ranks)
