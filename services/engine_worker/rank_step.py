"""One DP rank's per-step decisions around the step collective. Pure: no I/O, time passed in.

The live worker (worker.py) and the simulator (services/simulator/engine_group.py) drive
this same object, so what the simulator measures is what the ranks run:

    plan, row = rs.plan(now_s, stopping)      # local schedule + this rank's row
    view = exchange(rows)                      # the collective (torch all-gather / a list)
    action, released = rs.decide(plan, view, now_s)   # alignment, batch gate, RUN/IDLE/...
    ... forward, core.postprocess(plan, sampled, now) ...

``now_s`` is a monotonic clock in seconds (the worker's ``time.monotonic()``, the
simulator's virtual clock); deadlines of token alignment are judged on it.
"""

from __future__ import annotations

from typing import Any

from services.engine_worker.batch_gate import BatchGate, batch_number
from services.engine_worker.busy_meter import BusyMeter
from services.engine_worker.engine_scheduler import EngineScheduler, StepPlan
from services.engine_worker.prompt_window import PromptWindow
from shared.rate_meter import RateMeter
from services.engine_worker.step_view import (BUSY_FLAG, LULL_FLAG, TAIL_FLAG, F_ALIGN, F_ARRIVED, F_BUSY, F_COMPANY,
                                             F_ARRIVED_N, F_DECODE, F_GATE, F_GATE_HELD, F_FORCED, F_LONGEST, F_MUST,
                                             F_QUEUED, F_RELEASE, F_TOKENS, Action, StepView)
from services.engine_worker.sequence import Sequence
from services.engine_worker.step_clock import SMALL_SHARE, StepClock
from services.engine_worker.step_budget import (BudgetConfig, allowed, allowed_all, balanced_budget, lull_budget,
                                                must_tokens, shared_budget, tail_budget, tail_share, trim_plan,
                                                TAIL_MAX_FILL, TAIL_MIN_FILL)


# the mean prompt behind the lull test moves 1/20 of the way to each arrival (about the
# last 20 prompts here: a rank sees 1/ranks of the group's)
MEAN_PROMPT_WEIGHT = 0.05


class RankStep:
    """The scheduler, the staggered-batch gate and token alignment of one rank."""

    def __init__(self, rank: int, core: EngineScheduler, gate: BatchGate,
                 budget: BudgetConfig | None = None) -> None:
        self.rank = rank
        self.core = core
        self.gate = gate
        self.budget = budget                      # None: token alignment off on this rank
        self.since_s: dict[str, float] = {}       # when each sequence reached this rank
        self.blocked_s = float("-inf")            # last plan that could admit nothing (no slot / KV)
        self.last_step_ms = 0.0                   # measured duration of the last step (deadline planning)
        self.capped_steps = 0                     # consecutive steps the budget capped this rank's prefill
        self.backlog = 0.0                        # prefill pending on the other ranks, in full steps (last view)
        self.group_idle = True                    # last view: no rank decoded, none other had prefill pending
        self.group_quiet = True                   # last view: no rank decoded
        # the meter reads the pending prefill in full steps: its threshold in the same unit
        self.meter = BusyMeter(budget.busy_tokens / budget.max_tokens, budget.busy_tau_s) if budget is not None else None
        self.clock = StepClock(budget.max_tokens) if budget is not None else None
        self.step_tokens = 0                      # the busiest rank's tokens in the step last decided
        self.step_mean_tokens = 0.0               # and the ranks' mean tokens in it
        self.calm = False                         # this plan: prefill pending that need not wait (lone share low)
        self.tail_on = False                      # last view: the group spread a backlog's last prefill
        self.tail_share: int | None = None        # the spread's prefill per step, set where it began
        # prompt tokens/s reaching the group (every rank's F_ARRIVED, summed)
        self.prompt_rate = RateMeter(budget.lone_tau_s) if budget is not None else None
        # and over a short window, with the mean prompt and the last views that saw one arrive:
        # what tells a lull (no prompt for many arrivals' time) from a stream
        self.lull_rate = RateMeter(budget.lull_tau_s) if budget is not None else None
        self.mean_prompt = 0.0                    # prompt tokens, a moving average of this rank's arrivals
        self.last_arrival_s = float("-inf")       # the last view in which prompts reached some rank
        self.last_view_s = float("-inf")          # the last view
        self.ranks = 0                            # the group's size, as of the last view (0: none yet)
        # the group's last prompts' sizes, from every rank's row: how long the long ones are
        # (the long-prompt wait); and the prompts that arrived here, not yet in a row the group saw
        self.prompts = PromptWindow(budget.long_window) if budget is not None and budget.long_quantile > 0 else None
        self.unreported: list[int] = []

    @property
    def arrived_tokens(self) -> int:
        """Prompt tokens arrived here, not yet in a row the group saw."""
        return sum(self.unreported)

    def note_step(self, dur_ms: float) -> None:
        """The step that just ran took ``dur_ms`` (deadlines plan with it, and the waits
        follow what a full step costs)."""
        self.last_step_ms = dur_ms
        if self.clock is not None:
            self.clock.observe(self.step_tokens, dur_ms, self.step_mean_tokens)

    def arrived(self, seq: Sequence, now_s: float) -> None:
        """``seq`` was queued on this rank (after ``core.add`` accepted it)."""
        self.since_s[seq.id] = now_s
        self.gate.on_arrival(seq)
        if self.budget is not None:
            n = seq.num_prompt_tokens
            m = self.mean_prompt
            self.mean_prompt = n if m <= 0 else m + MEAN_PROMPT_WEIGHT * (n - m)
            self.unreported.append(n)

    def _count_arrivals(self, view: StepView, now_s: float) -> None:
        """The prompt tokens every rank reported arriving: the group's prompt rate, the same
        sum on every rank (one rank's own arrivals, times the ranks, was too noisy to judge by)."""
        del self.unreported[:view.rows[self.rank][F_ARRIVED_N]]   # reported: counted once
        if self.prompts is not None:   # every rank adds the same rows: the same window everywhere
            for longest, rest, n in _arrivals(view):
                self.prompts.add(longest)
                self.prompts.add_many(rest, n - 1)
        total = view.memo.get("arrived")
        if total is None:
            total = view.memo["arrived"] = sum(view.column(F_ARRIVED))
        self.prompt_rate.add(total, now_s)
        self.lull_rate.add(total, now_s)
        if total > 0:
            self.last_arrival_s = now_s
        self.last_view_s = now_s
        self.ranks = len(view.rows)

    def in_lull(self, now_s: float) -> bool:
        """No prompt has reached the group since the view at ``last_arrival_s`` while
        ``lull_prompts`` were due at its recent rate. Judged up to the last view (arrivals
        reach the rows one step late: a long step is no lull)."""
        cfg = self.budget
        if cfg is None or cfg.lull_prompts <= 0 or self.mean_prompt <= 0:
            return False
        quiet = self.last_view_s - self.last_arrival_s
        rate = self.lull_rate.rate(now_s)   # 0 until a view counted an arrival (then quiet is inf: no lull)
        return quiet > 0 and rate > 0 and quiet * rate >= cfg.lull_prompts * self.mean_prompt

    def _company_worth(self, now_s: float, queued: int) -> float:
        """How much of the wait for company is in force: none while prefilling every prompt
        alone would take under ``lone_share`` of the group's time (a lone prefill then
        delays the decodes little, and waiting only delays its first token), all of it from
        ``lone_share_full``, in proportion between; all of it until a step is measured,
        but none for a small prefill (``queued`` tokens) where the steps stay small and so
        no step can be measured (the clock's ``small_steps``: chat-sized prompts among
        decodes; every first token waited the 200 ms meant for the first steps)."""
        cfg = self.budget
        if (self.clock.full_step_ms <= 0 and self.clock.small_steps
                and queued < SMALL_SHARE * self.clock.max_tokens):
            return 0.0
        return self._share_worth(cfg.lone_share, cfg.lone_share_full, now_s)

    def _growth_worth(self, now_s: float) -> float:
        """How much of the wait's growth with the backlog is in force: none while every
        prompt prefilled alone would take under ``grow_share`` of the group's time (there is
        headroom: the minimum wait already finds the company there is, and waiting longer
        only delays first tokens), all of it from ``grow_share_full``; always all of it
        where ``grow_share_full`` is 0, and while the group is busy: prompts reach a full
        group only as its slots free, so the share reads low behind a queue."""
        cfg = self.budget
        if cfg.grow_share_full <= 0 or self.meter.busy:
            return 1.0
        return self._share_worth(cfg.grow_share, cfg.grow_share_full, now_s)

    def _share_worth(self, lo: float, full: float, now_s: float) -> float:
        """0 below a lone-prefill share of ``lo``, 1 from ``full``, in proportion between;
        1 until a step is measured."""
        if self.clock.full_step_ms <= 0:
            return 1.0
        span = max(1e-9, full - lo)
        return min(1.0, max(0.0, (self.lone_share(now_s) - lo) / span))

    def lone_share(self, now_s: float) -> float:
        """The share of the group's time its prefill would take if every prompt prefilled
        alone, in the part the other ranks idle through: the group's prompt tokens/s x the
        measured busiest-rank ms per token (what follows the group's total, a shared device,
        is spent whether prefills run together or not)."""
        return self.prompt_rate.rate(now_s) * self.clock.token_ms / 1000.0

    def company_shortfall(self, now_s: float) -> float:
        """How far the prompts reaching the group fall short of ``company_prompts`` per rank
        per full-step time, the rate from which waiting for company pays: 0 from there (and
        until a full step is measured), 1 with none arriving, in proportion between. The
        balance a backlogged step must keep shrinks with it (rank 0's figure, ``_budget``):
        a step held back for the ranks without prefill waits for the next prompts to reach
        them, and prompts of many steps each arrive about once a step, so every other rank
        idled through that wait (fixed:16000:16 on 8 ranks: 0.88 of ideal at 1.0x, against
        0.97 for placement alone; docs/benchmarks.md)."""
        cfg = self.budget
        full_ms = self.clock.full_step_ms
        if cfg.company_prompts <= 0 or full_ms <= 0 or self.mean_prompt <= 0 or self.ranks <= 0:
            return 0.0
        per_rank = self.prompt_rate.rate(now_s) / self.mean_prompt * full_ms / 1000.0 / self.ranks
        return max(0.0, 1.0 - per_rank / cfg.company_prompts)

    def forget(self, seq_id: str) -> None:
        self.since_s.pop(seq_id, None)

    def plan(self, now_s: float, stopping: bool = False, admit: bool = True) -> tuple[StepPlan, list[int]]:
        """This step's unconstrained local plan and this rank's row of the collective.
        ``admit=False``: no new prefill starts this step (a group-wide prefill gate said
        so); decodes and prefills under way still run."""
        core, gate = self.core, self.gate
        if not admit:
            plan = core.schedule(_never)
        else:
            plan = core.schedule(gate.may_prefill if gate.counts else None)
        complete, oldest_held, release = gate.row()
        if core.waiting and (core.num_running >= core.max_num_seqs or
                             not core.bm.can_allocate(core.waiting[0], core.waiting[0].num_tokens)):
            self.blocked_s = now_s   # a full rank: its queue's prefill deadlines start when room appears
        must = queued = 0
        self.calm = False
        if self.budget is not None:
            must, queued = self.prefill_need(plan, now_s)
        forced = int(self.budget is not None and (self.calm or 0 < self._capped_limit() <= self.capped_steps))
        busy = ((BUSY_FLAG if self.meter is not None and self.meter.busy else 0) | (TAIL_FLAG if self.tail_on else 0)
                | (LULL_FLAG if self.in_lull(now_s) else 0))
        row = [int(core.has_work()), plan.num_tokens, plan.max_context, complete, oldest_held,
               release, int(stopping), plan.decode_tokens, must, int(self.budget is not None), queued, forced,
               busy, self.arrived_tokens, max(self.unreported, default=0), len(self.unreported),
               round(1000 * self.company_shortfall(now_s)) if self.budget is not None else 0]
        return plan, row

    def prefill_need(self, plan: StepPlan, now_s: float) -> tuple[int, int]:
        """(tokens this rank's prefill deadlines need this step, prefill tokens pending here
        — running prefills and the waiting queue, read up to 64 sequences)."""
        if plan.no_prefill_pending:   # the common decode-only rank: no list to build
            return min(self.budget.max_tokens, plan.decode_tokens), 0
        since = self.since_s
        now_ms = now_s * 1000.0
        seqs = [q for q in self.core.running if q.is_prefilling]
        pending = [(since.get(q.id, now_s) * 1000.0, q.pending_prefill()) for q in seqs]
        if len(pending) < 64:
            blocked = self.blocked_s
            for q in self.core.waiting:
                if not q.held:
                    seqs.append(q)
                    pending.append((max(since.get(q.id, now_s), blocked) * 1000.0, q.pending_prefill()))
                    if len(pending) >= 64:
                        break
        queued = sum(p for _, p in pending)
        cfg = self.budget
        if self._idle_hold(plan, pending, now_ms):
            return 0, queued
        # a prefill may wait for company min_delay, longer in proportion to the prefill
        # pending on the other ranks (what it could share a balanced step with) where the
        # group has no headroom (the growth's worth)
        delay = None
        if cfg.min_balance > 0:
            lo, hi = self.delays_ms()
            grown = hi * min(1.0, self.backlog / self._backlog_steps())
            if grown > lo:   # only then can the growth's worth change the wait
                grown *= self._growth_worth(now_s)
            delay = max(lo, grown)
            if cfg.lone_share > 0:
                delay *= self._company_worth(now_s, queued)
                # nothing to wait for beside decodes: it runs now, backlog or not (forced)
                self.calm = delay == 0 and not self.group_quiet
            if self.group_idle:   # nobody decodes, nobody else prefills: a lone step delays no one
                delay = min(delay, cfg.idle_wait_ms)
            elif self.group_quiet:   # nobody decodes: a step of prefill alone delays no one
                delay = min(delay, lo)
            if cfg.step_ms <= 0 and self.last_step_ms <= 0:   # no step measured yet: crumbs
                delay = 0.0                                    # paced by a guess only delay it
            # (a busy group's waits are its own: they grow with the backlog)
            if delay > 0 and not self.group_idle and not self.meter.busy:
                pending = self._long_prompt_waits(pending, seqs, delay)
        return must_tokens(plan.decode_tokens, pending, now_ms, self.last_step_ms, cfg, delay), queued

    def long_prompt_tokens(self) -> int | None:
        """How long the group's long prompts are (the ``long_quantile`` of its last
        ``long_window``), or None: the rule is off, or too few prompts have come."""
        return self.prompts.quantile(self.budget.long_quantile) if self.prompts is not None else None

    def _long_prompt_waits(self, pending: list[tuple[float, int]], seqs: list[Sequence],
                           delay_ms: float) -> list[tuple[float, int]]:
        """``pending`` with each prompt's deadline moved out to the long-prompt wait, where
        that is later than ``delay_ms``: ``long_share`` of the full-rate prefill time of the
        ``long_quantile`` of the group's last prompts, less the prompt's own. Its first
        token still comes before the long prompts', so the TTFT tail stays theirs, and the
        longer window lets more ranks' slices share steps."""
        cfg = self.budget
        q = self.long_prompt_tokens()
        full = self.clock.full_step_ms
        if q is None or full <= 0:
            return pending
        per_token = full / cfg.max_tokens
        wait = cfg.long_share * q * per_token
        if wait <= delay_ms:   # log-normal prompts: the long ones fit in the wait already
            return pending
        return [(since + max(0.0, wait - seq.num_prompt_tokens * per_token - delay_ms), rem)
                for (since, rem), seq in zip(pending, seqs)]

    def _idle_hold(self, plan: StepPlan, pending: list[tuple[float, int]], now_ms: float) -> bool:
        """No rank decoded in the last step and this rank's oldest pending prefill arrived
        less than ``idle_hold_ms`` ago: report no tokens needed, so that the group holds
        while requests sent together reach the other ranks (the budget ends the hold once
        every rank has a full step of prefill, or any rank's hold is over)."""
        hold = self.budget.idle_hold_ms
        if hold <= 0 or not self.group_quiet or plan.decode_tokens or not pending:
            return False
        return now_ms - min(s for s, _ in pending) < hold

    def decide(self, plan: StepPlan, view: StepView, now_s: float) -> tuple[Action, int]:
        """Apply the group's rows: token alignment (trims ``plan``), the batch gate's
        shared verdict; returns this rank's action and how many batches were released."""
        align = view.memo.get("align")
        if align is None:
            align = view.memo["align"] = all(view.column(F_ALIGN))
        if self.budget is not None and align:
            T = view.memo.get("budget")
            if T is None:   # the same on every rank: computed once per view
                T = view.memo["budget"] = self._budget(view)
            self.tail_on = view.memo.get("tail", False)
            # the prefill pending on the OTHER ranks, in full steps: what a capped prefill could
            # share a balanced step with (waiting for nobody is futile)
            q = view.column(F_QUEUED)
            full = len(q) * self.budget.max_tokens
            self.backlog = (_queued(view) - q[self.rank]) / full
            self.group_quiet = _decodes(view) == 0
            self.group_idle = self.backlog == 0 and self.group_quiet
            self.meter.observe(_queued(view) / full, now_s)
            planned = plan.num_tokens
            trim_plan(plan, allowed(plan.decode_tokens, plan.num_tokens, T))
            if T:   # a hold (no forward) is not a capped step
                self.capped_steps = self.capped_steps + 1 if plan.num_tokens < planned else 0
            if plan.dropped and plan.admitted:   # capped to nothing: release their KV too
                gone = set(plan.dropped)
                self.core.unadmit([q for q in plan.admitted if q.id in gone])
        if self.budget is not None:
            self._count_arrivals(view, now_s)
        if self.clock is not None:   # the busiest rank's and the mean tokens: what the step's duration is measured against
            self.step_tokens, self.step_mean_tokens = view.max_tokens, view.mean_tokens
        released = 0
        gate = self.gate
        held = view.memo.get("held")
        if held is None:
            held = view.memo["held"] = any(view.column(F_GATE_HELD))
        if gate.counts or held:
            released = gate.after_exchange(view.column(F_GATE), view.column(F_GATE_HELD),
                                           view.rows[0][F_RELEASE], now_s)
            gate.forget_done({batch_number(q.batch) for q in self.core.waiting if q.held})
        return view.action(self.rank), released

    def delays_ms(self) -> tuple[float, float]:
        """(min, max) wait for company in ms: in full-step times once a full step is
        measured, the configured ms until then (or where no wait is set in steps)."""
        cfg = self.budget
        full = self.clock.full_step_ms
        lo = cfg.min_delay_steps * full if cfg.min_delay_steps > 0 and full > 0 else cfg.min_delay_ms
        hi = cfg.max_delay_steps * full if cfg.max_delay_steps > 0 and full > 0 else cfg.max_delay_ms
        return lo, hi

    # This rank's own choices (its deadlines, its capped-steps bound) follow its own meter;
    # the shared budget follows rank 0's, read from the rows, so that every rank computes
    # the same T (a rank that joined later has a shorter history).
    def _capped_limit(self) -> int:
        cfg = self.budget
        return cfg.busy_capped_steps if self.meter.busy else cfg.max_capped_steps

    def _backlog_steps(self, busy: bool | None = None) -> float:
        cfg = self.budget
        return cfg.busy_backlog_steps if (self.meter.busy if busy is None else busy) else cfg.backlog_steps

    def _tail(self, view: StepView) -> bool:
        """A busy group's backlog is ending on every rank alike: each has prefill left, none
        as much as ``TAIL_MAX_FILL`` of a full step, and the group decodes (so the steps that
        spread the rest run anyway). Where only some ranks have prefill, it is new arrivals,
        which alignment serves; a remainder near a full step is a prefill step of its own
        (spread, it only puts more decodes on long steps: docs/benchmarks.md), and one under
        ``TAIL_MIN_FILL`` runs whole unless the spread began above it (rank 0's row says
        so: every rank then decides alike)."""
        cfg = self.budget
        flags = view.rows[0][F_BUSY]
        if cfg.tail_steps <= 0 or not flags & BUSY_FLAG or not _decodes(view):
            return False
        q = view.column(F_QUEUED)
        if not all(q):
            return False
        least = 0.0 if flags & TAIL_FLAG else TAIL_MIN_FILL * cfg.max_tokens
        return least <= max(q) < TAIL_MAX_FILL * cfg.max_tokens

    def _budget(self, view: StepView) -> int:
        """This step's shared token budget (the same on every rank: a function of the rows)."""
        cfg = self.budget
        decode, tokens, must = view.column(F_DECODE), view.column(F_TOKENS), view.column(F_MUST)
        if cfg.min_balance > 0 and _holding(view, cfg.max_tokens):
            T = 0   # nobody decodes, every prefill just arrived, some rank short of a full step: no forward
        elif cfg.min_balance > 0:
            # the largest budget most ranks can fill; fewer where company comes seldom (rank
            # 0's shortfall), unless a rank cannot start what it holds: room freeing there is
            # company that will come (as in a lull); a rank capped max_capped_steps in a row runs
            blocked = _any_blocked(view)
            floor = cfg.min_balance
            if not blocked:
                floor *= 1.0 - min(1000, max(0, view.rows[0][F_COMPANY])) / 1000.0
            T = balanced_budget(decode, tokens, floor, cfg.max_tokens)
            # busy, and some rank cannot start what it holds: short steps free its room sooner
            if cfg.blocked_tokens > 0 and view.rows[0][F_BUSY] & BUSY_FLAG and blocked:
                T = min(T, max(decode) + cfg.blocked_tokens)
            # in a lull nobody is coming: balanced among the ranks that have prefill
            if cfg.lull_prompts > 0 and view.rows[0][F_BUSY] & LULL_FLAG:
                T = max(T, lull_budget(decode, tokens, view.column(F_QUEUED), cfg.min_balance, cfg.max_tokens))
            headroom = self._backlog_steps(bool(view.rows[0][F_BUSY] & BUSY_FLAG))
            # TTFT first, prefill deadlines hold, until the ranks' pending prefill could fill
            # `headroom` of a full group step: one long prompt, or one rank, alone is no backlog.
            # And where no rank decodes, backlog or not: no decode waits through a prefill step
            if (not _decodes(view)
                    or _fillable(view, cfg.max_tokens) / (len(decode) * cfg.max_tokens) < headroom):
                for t, m in zip(tokens, must):
                    T = max(T, min(int(t), int(m)))
            if self._tail(view):
                view.memo["tail"] = True
                q = view.column(F_QUEUED)
                if not view.rows[0][F_BUSY] & TAIL_FLAG or self.tail_share is None:
                    self.tail_share = tail_share(q, cfg)   # fixed for the spread: it ends in tail_steps steps
                T = min(T, tail_budget(decode, q, cfg, self.tail_share))
            for t, f in zip(tokens, view.column(F_FORCED)):
                if f:
                    T = max(T, int(t))
        else:
            T = shared_budget(decode, tokens, must, cfg)
        view.set_column(F_TOKENS, allowed_all(decode, tokens, T))
        return T


def _queued(view: StepView) -> int:
    """The group's pending prefill tokens (once per view)."""
    total = view.memo.get("queued")
    if total is None:
        total = view.memo["queued"] = sum(view.column(F_QUEUED))
    return total


def _arrivals(view: StepView) -> list[tuple[int, int, int]]:
    """The prompts each rank reported: (the longest, the mean of the others, how many) per
    rank that had any (once per view: a row carries the sum, the longest and the count)."""
    got = view.memo.get("arrivals")
    if got is None:
        got = view.memo["arrivals"] = [
            (row[F_LONGEST], (row[F_ARRIVED] - row[F_LONGEST]) // max(1, row[F_ARRIVED_N] - 1), row[F_ARRIVED_N])
            for row in view.rows if row[F_ARRIVED_N] > 0]
    return got


def _decodes(view: StepView) -> int:
    """The group's decode tokens this step (once per view)."""
    total = view.memo.get("decodes")
    if total is None:
        total = view.memo["decodes"] = sum(view.column(F_DECODE))
    return total


def _any_blocked(view: StepView) -> bool:
    """Some rank holds prefill it cannot start this step: queued, but its plan has only its
    decodes (its KV cannot take the next prompt, or its sequence slots are full)."""
    return any(q > 0 and t <= d for q, t, d in zip(view.column(F_QUEUED), view.column(F_TOKENS),
                                                    view.column(F_DECODE)))


def _holding(view: StepView, max_tokens: int) -> bool:
    """Every rank with prefill pending holds it (idle hold: its must is 0), nobody decodes,
    and some rank could still fill more of a full step (what the hold waits for)."""
    q = view.column(F_QUEUED)
    if not any(q) or all(x >= max_tokens for x in q) or _decodes(view):
        return False
    return not any(m for m, x in zip(view.column(F_MUST), q) if x) and not any(view.column(F_FORCED))


def _fillable(view: StepView, max_tokens: int) -> int:
    """The group's pending prefill that the next step could hold: each rank's counted up
    to one full step, and none while only one rank has any: nobody could share a step with
    it (in a group of 4, one rank's full step is a quarter of the group's, the busy
    threshold, and a lone long prompt in an idle group crawled through the capped-steps
    bound). Once per view."""
    total = view.memo.get("fillable")
    if total is None:
        capped = [min(q, max_tokens) for q in view.column(F_QUEUED) if q > 0]
        total = view.memo["fillable"] = sum(capped) if len(capped) > 1 else 0
    return total


def _never(seq: Sequence) -> bool:
    return False


def group_view(rows: list[list[Any]]) -> StepView:
    """The collective's result as every rank sees it (the simulator's exchange)."""
    return StepView([list(r) for r in rows])
