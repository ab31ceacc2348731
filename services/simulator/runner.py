"""One simulation run end to end: build the trace, run the ideal and every policy on it,
summarize. Used by ``lockstep simulate``, ``python -m services.simulator`` and
``scripts/bench-table``."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from shared.cost_model import CostModel
from services.simulator import profile as profile_mod
from services.simulator import report, workload
from services.simulator.baselines import PolicySpec
from services.engine_worker.step_budget import BudgetConfig
from services.simulator.sim import RunResult, SimConfig, resolve_policies, run_ideal, run_policy


def _with_params(spec: PolicySpec, params: dict[str, Any]) -> PolicySpec:
    """``KEY=VALUE`` go to the policy's constructor; ``budget.KEY=VALUE`` to the engine's
    per-step token budget (services/engine_worker/step_budget.py BudgetConfig)."""
    if not params:
        return spec
    bud = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("budget.")}
    params = {k: v for k, v in params.items() if not k.startswith("budget.")}
    if bud:
        if spec.step_budget is None:
            raise ValueError(f"{spec.name} runs without a step budget; budget.* params do not apply")
        known = set(BudgetConfig.__dataclass_fields__) - {"max_tokens"}
        if set(bud) - known:
            raise ValueError(f"--param {spec.name}.budget.{sorted(set(bud) - known)[0]}: no such budget setting; "
                             f"known: {', '.join(sorted(known))}")
        spec = dataclasses.replace(spec, step_budget={**spec.step_budget, **bud})
        try:
            BudgetConfig(max_tokens=2048, **spec.step_budget)   # checked now, not mid-run
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--param {spec.name}.budget.*: {exc}") from None
    if not params:
        return spec
    base = spec.factory
    _check_types(spec.name, getattr(base, "policy_class", None), params)

    def make(**kw: Any) -> Any:   # extra constructor arguments reach the policy unchanged
        try:
            return base(**kw, **params)
        except (TypeError, ValueError) as exc:   # an unknown key, a value of the wrong type
            given = ", ".join(f"{spec.name}.{k}={v!r}" for k, v in params.items())
            raise ValueError(f"--param {given}: {spec.name} cannot take it ({exc})") from None
    # built once now: an unknown key is refused before the run, not in its middle
    make(dispatcher_id="check", client_index=0, num_api_servers=1, client_mode=False, ranks=[0, 1], block_size=16)
    return dataclasses.replace(spec, factory=make)


def _check_types(name: str, cls: type | None, params: dict[str, Any]) -> None:
    """Each value of the kind the constructor's default is (a number where it takes a
    number, finite): "abc" for a number was accepted and crashed mid-run in a product."""
    import inspect
    import math
    if cls is None:
        return
    sig = inspect.signature(cls)
    for key, value in params.items():
        p = sig.parameters.get(key)
        if p is None or p.default is inspect.Parameter.empty or p.default is None:
            continue      # unknown keys: the constructor says so; no default: no kind to check
        want = p.default
        if isinstance(want, bool):
            ok = isinstance(value, bool)
        elif isinstance(want, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and (isinstance(want, float) or float(value).is_integer())
        elif isinstance(want, str):
            ok = isinstance(value, str)
        else:
            continue
        if not ok:
            kind = "true or false" if isinstance(want, bool) else "a whole number" if isinstance(want, int) \
                else "a finite number" if isinstance(want, float) else "a string"
            raise ValueError(f"--param {name}.{key}={value!r}: {name}.{key} takes {kind} (its default is {want!r})")


def run(*, ranks: int, api_servers: int, workload: str = "bursty", requests: int = 10000,
        rate: float = 24.0, seed: int = 0, trace: Path | str | None = None,
        policies: str | list[str] = "all", cost_model: Path | str | None = None,
        params: dict[str, dict[str, Any]] | None = None, progress: bool = False,
        cfg: SimConfig | None = None, profile: str | Path | None = None,
        dispatch: str | None = None, view_interval_ms: float | None = None,
        tr: Any = None) -> tuple[dict[str, Any], list[RunResult]]:
    prof = profile_mod.load(profile)
    cost = CostModel.load(cost_model) if cost_model else prof.cost
    cfg = cfg or SimConfig()
    cfg = dataclasses.replace(cfg, ranks=ranks, api_servers=api_servers, cost=cost, seed=seed,
                              engine=prof.engine, dispatch=dispatch,
                              view_interval_ms=view_interval_ms if view_interval_ms is not None else cfg.view_interval_ms)
    if tr is not None:
        pass
    elif trace is not None:
        tr = workload_mod.load_jsonl(trace, api_servers=api_servers, seed=seed,
                                     max_model_len=cfg.engine.max_model_len)
    else:
        tr = workload_mod.generate(workload, requests, rate, seed, api_servers,
                                   max_model_len=cfg.engine.max_model_len)
    params = params or {}
    specs = resolve_policies(policies, cfg)
    unknown = set(params) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"--param for policies not run: {sorted(unknown)}")
    specs = [_with_params(s, params.get(s.name, {})) for s in specs]

    bar = None
    ctx: Any = nullcontext()
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        ctx = bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                             TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    results: list[RunResult] = []
    with ctx:
        task = bar.add_task("ideal", total=len(tr) * (len(specs) + 1)) if bar else None
        with _IdealRun(tr, cfg, beside=bool(specs)) as pending:
            for spec in specs:
                if bar:
                    bar.update(task, description=spec.name)
                cb = (lambda k: bar.advance(task, k)) if bar else None
                results.append(run_policy(tr, spec, cfg, progress=cb))
            ideal = pending.result()
        if bar:
            bar.advance(task, len(tr))
    config = {"ranks": ranks, "api_servers": api_servers, "workload": workload if trace is None else None,
              "requests": len(tr), "rate": rate if trace is None else None, "seed": seed,
              "trace": {**tr.describe(), "file": str(trace) if trace else None},
              "policies": [s.name for s in specs], "params": params,
              "profile": {"name": prof.name, "source": prof.source},
              "dispatch": dispatch or "each system's own",
              "sim": cfg.to_dict()}
    doc = report.document(config, results, ideal)
    doc["default"] = DEFAULT_SIM_POLICY if DEFAULT_SIM_POLICY in doc["policies"] else None
    return doc, results


class _IdealRun:
    """The ideal run of a trace, in a forked process beside the policies' runs when the
    machine has a core to spare and the trace is large enough to repay the fork (it is a
    third of a one-policy run's time: 100,000 requests x 32 ranks, 26 s of 85 s)."""

    MIN_REQUESTS = 20000

    def __init__(self, tr: Any, cfg: SimConfig, beside: bool) -> None:
        self.tr, self.cfg, self._pool, self._future = tr, cfg, None, None
        if beside and len(tr) >= self.MIN_REQUESTS and (os.cpu_count() or 1) > 1 \
                and multiprocessing.current_process().daemon is False:
            try:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
                self._future = self._pool.submit(run_ideal, tr, cfg)
            except (OSError, ValueError):   # no fork here: run it in line instead
                self._pool = None

    def __enter__(self) -> "_IdealRun":
        return self

    def result(self) -> RunResult:
        if self._future is not None:
            try:
                return self._future.result()
            except BrokenProcessPool:    # the child died (memory): run it in line
                pass
        return run_ideal(self.tr, self.cfg)

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


workload_mod = workload
DEFAULT_SIM_POLICY = "default"   # the policies entry that is what `lockstep up` runs
