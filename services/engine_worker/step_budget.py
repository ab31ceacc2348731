"""Per-step token alignment across DP ranks: one shared token budget per step.

In DP+EP a step lasts as long as its busiest rank. Without alignment one rank prefills a
2048-token chunk while the others decode a few dozen tokens, and the whole group waits
for it (balance ratio ~0.05 for that step). Every rank already shares its planned tokens
in the step collective before the forward; with two more numbers per rank every rank can
compute, from the same rows, the same per-rank token **budget** ``T`` for this step and
cap its own prefill so that ``decode + prefill <= T``. Big prefills then spread over
several steps in which the other ranks compute about as much, instead of one step in which
they idle.

Pure: no I/O, no clock; the same functions run in the live worker and the simulator (both
through services/engine_worker/rank_step.py), and every rank gets the same answer because
it reads the same rows.

Inputs per rank ``r`` (one row of the step collective)
------------------------------------------------------
* ``tokens[r]``: tokens its unconstrained plan would compute (decode + available prefill,
  ``<= max_num_batched_tokens``): the existing ``F_TOKENS`` column;
* ``decode[r]``: the decode tokens among them (never held back): new column ``F_DECODE``;
* ``must[r]``: :func:`must_tokens`, decode + the prefill rate its own deadlines require this
  step (computed by the rank from its own clock): new column ``F_MUST``.

Rule (``shared_budget``)
------------------------
``avail[r] = tokens[r] - decode[r]`` (prefill it could do), ``D = max decode``.

1. **Water level.** ``level = q-quantile over ranks of decode[r] + avail[r] / horizon``
   (``q = spread``; 0 is the least loaded rank). When every rank has prefill, every rank
   computes exactly ``T``: a balanced step that drains the backlog over ~``horizon`` steps.
2. **Never below the decodes.** ``T >= D``: decodes never wait; below ``D`` the other
   ranks fill up to ``D`` with prefill for free (the step lasts ``D`` anyway).
3. **Minimum chunk.** ``T >= D + min_chunk`` when some rank has prefill (default 0).
4. **Deadlines.** ``T >= min(must[r], tokens[r])`` for every rank: a rank whose prefills
   would otherwise miss ``max_delay_ms`` raises the budget, and every other rank with
   pending prefill fills up to the same ``T`` (the step lasts that long anyway). So no
   prefill finishes later than ``max_delay_ms`` after it became schedulable, plus the
   steps its own size needs at ``max_tokens`` per step (no starvation).
5. ``1 <= T <= max_tokens``.

Each rank then computes ``allowed(decode[r], tokens[r], T) = min(tokens[r], max(decode[r],
T))`` tokens: all its decodes and ``min(avail, T - decode)`` prefill tokens.

Where it runs
-------------
services/engine_worker/rank_step.py (``RankStep``) builds each rank's row and applies the
budget after the exchange, in the live worker and in the simulator alike. With
``min_balance > 0`` (the default engine settings) it uses :func:`balanced_budget` (the
largest budget most ranks can fill) instead of the water level of rule 1, with a bounded
hold (``max_hold_steps``) and deadlines scaled by the prefill pending on the other ranks.

The budget never changes which sequences run, only how many prefill tokens each computes
this step: continuing prefills first, then admissions FCFS (the order of the engine's
scheduler), so trimming a plan to the budget cuts from its newest work.
"""

from __future__ import annotations

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
    backlog_steps: float = 1.0      # a backlog: the group's pending prefill fills this many full steps
    max_hold_steps: int = 0         # >0: a rank whose prefill was held this many steps in a row runs it
    min_delay_ms: float = 0.0       # with min_balance: a prefill may wait this long even with no backlog

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.horizon < 1:
            raise ValueError("horizon must be >= 1")
        if not 0.0 <= self.spread < 1.0:
            raise ValueError("spread must be in [0, 1)")
        if self.min_chunk < 0 or self.max_delay_ms < 0:
            raise ValueError("min_chunk and max_delay_ms must be >= 0")
        if not 0.0 <= self.min_balance < 1.0:
            raise ValueError("min_balance must be in [0, 1)")


def from_settings(settings: Any) -> BudgetConfig | None:
    """The budget an engine runs with (shared/settings.py EngineSettings): None when
    coordinated prefill is off. The worker and the simulator's ``default`` entry both use
    it, so the simulated default is the product's."""
    if not settings.align_tokens:
        return None
    return BudgetConfig(max_tokens=settings.max_num_batched_tokens, max_delay_ms=settings.align_max_delay_ms,
                        min_delay_ms=settings.align_min_delay_ms, backlog_steps=settings.align_backlog_steps,
                        min_balance=settings.align_min_balance, max_hold_steps=settings.align_max_hold_steps,
                        step_ms=0.0)


def shared_budget(decode: Sequence[int], tokens: Sequence[int], must: Sequence[int] | None = None,
                  cfg: BudgetConfig = BudgetConfig()) -> int:
    """The per-rank token budget ``T`` of this step (same on every rank; see the module
    docstring). ``decode``, ``tokens``, ``must`` are indexed by position in the group;
    ``must[r]`` is rank r's :func:`must_tokens` (None: no deadlines)."""
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


def must_tokens(decode: int, pending: Iterable[tuple[float, int]], now_ms: float, step_ms: float,
                cfg: BudgetConfig = BudgetConfig(), max_delay_ms: float | None = None) -> int:
    """Tokens rank-local deadlines require this step: ``decode`` plus the prefill rate that
    finishes every pending prefill within ``max_delay_ms`` of when it became schedulable
    here, if later steps last about ``step_ms`` and run at the same rate (as late as
    possible: the rest of the group can then align with this rank instead of it racing
    ahead alone).

    ``pending``: ``(since_ms, remaining_prefill_tokens)`` in the order the scheduler
    serves them (running prefills, then the waiting queue FCFS). For the j-th, with ``C_j``
    the tokens up to and including it and ``k_j = max(1, floor((since_j + max_delay_ms -
    now_ms) / step_ms))`` the steps it has left, the rate is ``max_j ceil(C_j / k_j)``. A
    prefill at its deadline therefore gets all its tokens (up to ``max_tokens`` a step):
    no prefill waits longer than ``max_delay_ms`` plus the steps its own size needs.
    Reads at most ``max_tokens`` tokens' worth of ``pending`` (bounded work)."""
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
    """Cut a :class:`~services.engine_worker.scheduler.StepPlan` to ``limit`` tokens in
    place (the live worker's use). Decode chunks are kept; prefill chunks are cut from the
    end of the plan (the newest work: admissions come after continuations), a partial
    chunk keeps its first tokens and stops sampling. A sequence whose chunk is cut to
    nothing stays admitted with ``num_computed_tokens`` unchanged, so the scheduler
    continues its prefill next step (its KV blocks are already reserved). Returns the plan.
    """
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
