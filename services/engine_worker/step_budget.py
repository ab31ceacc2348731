"""Coordinated prefill: one token budget ``T`` per step, shared by every DP rank.

A DP+EP step lasts as long as its busiest rank, so every rank caps its prefill at the same
``T`` (decodes never wait) and a big prefill spreads over steps in which the others compute
about as much. Each rank computes ``T`` from the same rows of the step collective, so all
agree without another exchange. Pure (no I/O, no clock); rank_step.py runs it, live and in
the simulator. The rules and the figures behind them: docs/architecture.md, "Coordinated
prefill budget".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    """Knobs of :func:`shared_budget` (the defaults are the simulator's best, see
    docs/benchmarks.md)."""

    max_tokens: int = 2048          # max_num_batched_tokens: no rank ever exceeds it
    horizon: float = 4.0            # a rank prefills ~1/horizon of its available prefill per step
    spread: float = 0.0             # quantile of the level (0 = the least loaded rank)
    min_chunk: int = 0              # a step with prefill lets every rank add at least this much
    max_delay_ms: float = 300.0     # bounded delay: every prefill done this long after it became schedulable
    step_ms: float = 10.0           # step time must_tokens plans with (0: the caller's measured step)
    min_balance: float = 0.0        # >0: under a backlog, the largest budget whose step stays this balanced
    # >0: min_balance holds in full only while at least this many prompts reach the group
    # per rank per full-step time, and in proportion below (rank_step.company_shortfall)
    company_prompts: float = 0.0
    backlog_steps: float = 1.0      # a backlog: pending prefill (<= a full step per rank) fills this of a group step
    max_capped_steps: int = 0       # >0: a rank whose prefill was capped this many steps in a row runs it
    min_delay_ms: float = 0.0       # with min_balance: a prefill may wait this long even with no backlog
    # with min_balance: the longest a prefill waits in an idle group (no rank decodes, none
    # has other prefill pending); a lone step there delays nobody (inf: no such cap)
    idle_wait_ms: float = float("inf")
    # with min_balance: while no rank decodes, a prefill that arrived less than this ago holds
    # (no forward) until every rank has a full step of prefill, so that requests sent
    # together land first and start in one step (0: no hold)
    idle_hold_ms: float = 0.0
    # >0: the two waits above in full-step times (what a max_tokens step takes, measured:
    # step_clock.py); the ms values stand until the engine has measured one
    min_delay_steps: float = 0.0
    max_delay_steps: float = 0.0
    # A busy group (its pending prefill averaged over busy_tau_s reaches busy_tokens prompt
    # tokens a rank; 0 = never): throughput-first, with these in place of backlog_steps and
    # max_capped_steps. In tokens, not full steps: an engine allowed larger steps is not
    # backlogged later (docs/benchmarks.md, "How the default decides", item 4)
    busy_tokens: float = 0.0
    busy_tau_s: float = 2.0
    busy_backlog_steps: float = 0.25
    busy_capped_steps: int = 64
    # >0: the waits for company are in force only while prefill would take at least this
    # share of the group's time if every prompt prefilled alone (the group's prompt tokens/s
    # x the measured ms per token), in full from lone_share_full; below, a prefill beside
    # decodes runs at once. lone_tau_s: the averaging time of that rate
    lone_share: float = 0.0
    lone_share_full: float = 0.0
    lone_tau_s: float = 10.0
    # >0: the wait's growth with the backlog (toward max_delay) is in force only while that
    # same lone-prefill share is at least grow_share, in full from grow_share_full: below 1,
    # every prompt prefilled alone would still fit in the group's time, so there is headroom
    # and a longer wait only delays first tokens (0: the growth is always in force; a busy
    # group keeps it whole too)
    grow_share: float = 0.0
    grow_share_full: float = 0.0
    # >0: a busy group's last prefill (every rank has some left, under TAIL_MAX_FILL of a full
    # step) rides on the decode steps that follow, each the same 1/tail_steps share of what
    # remained where the spread began and at least max_tokens/16, instead of one long step
    # every decode waits through (0: the backlog's last step runs whole)
    tail_steps: float = 0.0
    # >0: a lull is a time in which no prompt reached the group while this many were due at its
    # recent rate (prompt tokens/s over lull_tau_s, over the mean prompt); in a lull the ranks
    # with nothing queued are not waited for: company that has not arrived is not coming
    # (0: always waited for)
    lull_prompts: float = 0.0
    lull_tau_s: float = 2.0
    # >0: in a busy group, while some rank holds prefill it cannot start (its KV or sequence
    # slots are full), the budget is at most the largest decode plus this: that rank's room
    # frees only as its sequences finish, one token a step, so short steps bring the company
    # the balance rule waits for sooner (0: no cap; docs/benchmarks.md, item 2)
    blocked_tokens: int = 0
    # >0: while the group is not busy, a prompt may wait for company until long_share of
    # the time the long_quantile of the group's last long_window prompts takes to prefill at
    # full rate, less its own: its first token still comes before theirs, so the TTFT tail
    # stays theirs, and the longer window lets more ranks' slices share steps (heavy-tailed
    # prompts; 0: no such wait)
    long_quantile: float = 0.0
    long_share: float = 0.8
    long_window: int = 1024

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.horizon < 1:
            raise ValueError("horizon must be >= 1")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError("spread must be in [0, 1)")
        if (self.min_chunk < 0 or self.max_delay_ms < 0 or self.min_delay_steps < 0 or self.max_delay_steps < 0
                or self.idle_wait_ms < 0 or self.idle_hold_ms < 0):
            raise ValueError("min_chunk, max_delay_ms, idle_wait_ms, idle_hold_ms and the delays in steps must be >= 0")
        if not 0.0 <= self.min_balance < 1.0:
            raise ValueError("min_balance must be in [0, 1)")
        if self.lone_share < 0 or self.lone_share_full < self.lone_share or self.lone_tau_s <= 0:
            raise ValueError("lone_share must be >= 0, lone_share_full >= lone_share and lone_tau_s > 0")
        if self.grow_share < 0 or self.grow_share_full < 0 or 0 < self.grow_share_full < self.grow_share:
            raise ValueError("grow_share and grow_share_full must be >= 0, grow_share_full >= grow_share (or 0: always)")
        if self.tail_steps < 0:
            raise ValueError("tail_steps must be >= 0")
        if self.company_prompts < 0:
            raise ValueError("company_prompts must be >= 0")
        if self.blocked_tokens < 0:
            raise ValueError("blocked_tokens must be >= 0")
        if not 0.0 <= self.long_quantile < 1.0 or self.long_share < 0 or self.long_window < 1:
            raise ValueError("long_quantile must be in [0, 1), long_share >= 0 and long_window >= 1")
        if self.lull_prompts < 0 or self.lull_tau_s <= 0:
            raise ValueError("lull_prompts must be >= 0 and lull_tau_s > 0")
        if self.busy_tokens < 0 or self.busy_tau_s <= 0 or self.busy_backlog_steps <= 0 or self.busy_capped_steps < 0:
            raise ValueError("busy_tokens and busy_capped_steps must be >= 0, busy_tau_s and busy_backlog_steps > 0")


def from_settings(settings: Any) -> BudgetConfig | None:
    """The budget an engine runs with (shared/settings.py EngineSettings): None when
    coordinated prefill is off. The worker and the simulator's ``default`` entry both use
    it, so the simulated default is the product's."""
    if not settings.align_tokens:
        return None
    k = settings.wait_scale   # the sim backend's slow motion stretches the waits too
    return BudgetConfig(max_tokens=settings.max_num_batched_tokens, max_delay_ms=settings.align_max_delay_ms * k,
                        min_delay_ms=settings.align_min_delay_ms * k, idle_wait_ms=settings.align_idle_wait_ms * k,
                        idle_hold_ms=settings.align_idle_hold_ms * k,
                        min_delay_steps=settings.align_min_delay_steps, max_delay_steps=settings.align_max_delay_steps,
                        backlog_steps=settings.align_backlog_steps,
                        min_balance=settings.align_min_balance, max_capped_steps=settings.align_max_capped_steps,
                        company_prompts=settings.align_company_prompts,
                        busy_tokens=settings.align_busy_tokens, busy_tau_s=settings.align_busy_window_s * k,
                        busy_backlog_steps=settings.align_busy_backlog_steps,
                        busy_capped_steps=settings.align_busy_capped_steps,
                        lone_share=settings.align_lone_share, lone_share_full=settings.align_lone_share_full,
                        lone_tau_s=settings.align_lone_window_s * k, tail_steps=settings.align_tail_steps,
                        grow_share=settings.align_grow_share, grow_share_full=settings.align_grow_share_full,
                        lull_prompts=settings.align_lull_prompts, lull_tau_s=settings.align_lull_window_s * k,
                        blocked_tokens=settings.align_blocked_tokens,
                        long_quantile=settings.align_long_prompt_quantile,
                        long_share=settings.align_long_prompt_share,
                        long_window=settings.align_long_prompt_window,
                        step_ms=0.0)


def shared_budget(decode: Sequence[int], tokens: Sequence[int], must: Sequence[int] | None = None,
                  cfg: BudgetConfig = BudgetConfig()) -> int:
    """The water-level budget (``min_balance = 0``): the ``spread`` quantile of ``decode +
    prefill / horizon``, at least the largest decode (+ ``min_chunk`` with prefill), raised
    to any rank's ``min(tokens, must)``, within ``1..max_tokens``. Lists are indexed by
    position in the group; ``must`` None means no deadlines."""
    n = len(decode)
    if n == 0 or len(tokens) != n or (must is not None and len(must) != n):
        raise ValueError("decode, tokens and must need one entry per rank")
    B = cfg.max_tokens
    d_max = 0
    any_prefill = False
    levels = []
    for d, t in zip(decode, tokens):
        d = max(0, int(d))
        a = max(0, min(int(t), B) - d)
        if d > d_max:
            d_max = d
        if a > 0:
            any_prefill = True
        levels.append(d + a / cfg.horizon)
    if not any_prefill:
        return min(B, max(1, d_max))
    levels.sort()
    level = levels[min(n - 1, int(cfg.spread * n))]
    T = max(d_max, int(-(-level // 1)), d_max + cfg.min_chunk)
    if must is not None:
        for t, m in zip(tokens, must):
            m = min(int(t), int(m))
            if m > T:
                T = m
    return max(1, min(B, T))


def balanced_budget(decode: Sequence[int], tokens: Sequence[int], min_balance: float,
                    max_tokens: int) -> int:
    """The largest budget ``T`` whose step keeps ``sum(allowed) / (ranks x max(allowed))``
    at or above ``min_balance`` (throughput-first under a backlog): the step lasts as long
    as its busiest rank, so a budget only pays when most ranks can fill it. Candidates are
    the ranks' own levels (what each could compute) and the largest decode; at least the
    largest decode is always allowed (decodes never wait)."""
    n = len(decode)
    d_max = max(max(0, int(d)) for d in decode)
    caps = [min(int(t), max_tokens) for t in tokens]
    best = max(1, min(max_tokens, d_max))
    for T in sorted({c for c in caps if c > best}, reverse=True):
        got = [min(c, max(int(d), T)) for d, c in zip(decode, caps)]
        mx = max(got)
        if mx > 0 and sum(got) >= min_balance * n * mx:
            return T
    return best


def lull_budget(decode: Sequence[int], tokens: Sequence[int], queued: Sequence[int], min_balance: float,
                max_tokens: int) -> int:
    """In a lull (no prompt has reached the group for a while): :func:`balanced_budget` among
    the ranks with prefill queued, as if the ranks with none were not there, since the
    company they would bring is not coming. 0 (no change) when every rank or none has
    prefill queued, or when one of those that have cannot start it now (its KV or slots are
    full): room freeing there is company that will come, and waiting for it pays (letting
    the others run regardless collapsed a KV-bound group, docs/benchmarks.md)."""
    idx = [i for i, q in enumerate(queued) if q > 0]
    if not idx or len(idx) == len(queued) or any(tokens[i] <= decode[i] for i in idx):
        return 0
    return balanced_budget([decode[i] for i in idx], [tokens[i] for i in idx], min_balance, max_tokens)


# the tail spread applies to remainders under this share of a full step on every rank. On the
# gb200 offline sweep (seed 1) the backlog's last step held 23 / 47 % of one at 1.0 / 1.2x;
# spread, ITL p99 went 143 / 256 -> 57 / 83 ms. At 0.5 / 0.8x it held 93-98 %; spread, 23 / 25
# -> 74 / 89 ms (more decodes on long steps). 3/4 also spread 55-62 % remainders on seeds 2
# and 3, and cost there as often as it gained (docs/benchmarks.md, item 4)
TAIL_MAX_FILL = 0.5
# and a spread starts only from a remainder of at least this share (once started, it runs to
# the end). Under it the spread's floor, max_tokens/16 a step, makes two or three steps
# nearly as long as the one: each a slow interval for every decode, so twice the slow
# intervals for little shorter ones. gb200 offline seed 2 at 0.3x (a 12 % remainder): ITL
# p99 22 -> 49 ms spread; the spreads that pay start at 23 / 47 % (seed 1 at 1.0 / 1.2x)
TAIL_MIN_FILL = 0.2


def tail_budget(decode: Sequence[int], queued: Sequence[int], cfg: BudgetConfig, share: int | None = None) -> int:
    """The budget that spreads a backlog's last prefill over the decode steps that follow:
    the largest decode plus ``share`` (by default :func:`tail_share` of ``queued``), at
    least ``max_tokens/16``. Spent on steps that run for the decodes anyway, the same
    tokens cost the same time, but no step is one long prefill step that every decode
    waits through."""
    d_max = max((max(0, int(d)) for d in decode), default=0)
    if share is None:
        share = tail_share(queued, cfg)
    share = max(share, cfg.max_tokens // 16)
    return max(1, min(cfg.max_tokens, d_max + share))


def tail_share(queued: Sequence[int], cfg: BudgetConfig) -> int:
    """A ``1/tail_steps`` share of the most prefill any rank has pending. Taken where the
    spread begins and kept to its end (rank_step.py), so it ends in about ``tail_steps``
    steps: a share of what remains each step shrank geometrically (a remainder of 0.44 of a
    step took 7 steps, and the last first tokens waited through them)."""
    left = max((max(0, int(q)) for q in queued), default=0)
    return math.ceil(left / max(1.0, cfg.tail_steps))


def must_tokens(decode: int, pending: Iterable[tuple[float, int]], now_ms: float, step_ms: float,
                cfg: BudgetConfig = BudgetConfig(), max_delay_ms: float | None = None) -> int:
    """Tokens this rank's deadlines need this step: ``decode`` plus the rate that finishes
    every pending prefill (``(since_ms, remaining)``, in serving order) within
    ``max_delay_ms`` of its ``since``, if later steps last ``step_ms``: ``max_j ceil(C_j /
    k_j)``, ``C_j`` the tokens up to the j-th, ``k_j`` its steps left (at least 1). As late
    as possible, so the group can align with this rank; a prefill at its deadline gets
    everything. Reads at most ``max_tokens`` tokens' worth of ``pending``."""
    B = cfg.max_tokens
    step = max(float(cfg.step_ms if cfg.step_ms > 0 else step_ms), 1.0)
    delay = cfg.max_delay_ms if max_delay_ms is None else max_delay_ms
    need = 0
    cum = 0
    for since, rem in pending:
        if rem <= 0:
            continue
        cum += int(rem)
        left = (since + delay - now_ms) / step
        k = max(1, int(left))
        r = -(-cum // k)
        if r > need:
            need = r
        if cum >= B or need >= B:
            break
    return min(B, int(decode) + need)


def allowed(decode: int, tokens: int, budget: int) -> int:
    """Tokens a rank computes under ``budget``: all its decodes, then prefill up to it."""
    return min(int(tokens), max(int(decode), int(budget)))


def allowed_all(decode: Sequence[int], tokens: Sequence[int], budget: int) -> list[int]:
    return [allowed(d, t, budget) for d, t in zip(decode, tokens)]


def trim_plan(plan: Any, limit: int) -> Any:
    """Cut a StepPlan to ``limit`` tokens in place and return it. Decodes are kept;
    prefill is cut from the end (the newest work), a partial chunk keeps its first tokens
    and stops sampling, and a chunk cut to nothing is listed in ``plan.dropped`` (the
    caller un-admits such admissions, so they hold no KV blocks)."""
    excess = plan.num_tokens - max(int(limit), plan.decode_tokens)
    if excess <= 0:
        return plan
    keep = []
    for ch in reversed(plan.prefill_chunks):
        if excess <= 0:
            keep.append(ch)
            continue
        cut = min(excess, ch.num_tokens)
        excess -= cut
        plan.prefill_tokens -= cut
        if cut < ch.num_tokens:
            keep.append(replace(ch, token_ids=ch.token_ids[:ch.num_tokens - cut], sample=False))
        else:
            plan.dropped.append(ch.seq_id)
    keep.reverse()
    plan.set_prefill(keep)
    return plan
