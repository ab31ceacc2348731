"""``lockstep watch``: a live terminal dashboard of one cluster, read from Redis alone.

Every frame reads: the cluster record, the ranks' last stats and inbox backlogs
(services.admin.status.collect), the finalized steps of the last ``--window`` seconds
(``<ns>:steps``), and the output streams of the same window for time to first token.

Measures come from shared/measures.py (the definitions of DESIGN §6):
- balance ratio and idle-forward fraction over the window's finalized steps;
- step rate = finalized steps in the window / window length;
- TTFT p50/p90/p99 = (first output-stream entry holding a request's token 0, by its
  stream id's ms clock) - the request's ``t_arrival``: time to the engine's first token,
  without the api-server's last hop to the client. Requests placed by api-servers in
  client-dispatch mode have no ``t_arrival`` until they finish, so they count once done.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import typer

from services.admin.cmd_common import console as out_console, JSON_OPT, NS_OPT, URL_OPT, as_str, emit_json, resolve, require_cluster
from services.admin.status import request_queue
from services.admin.steps_cmd import read_steps
from shared import keys as K
from shared.bus import decode_entries, entry_id_key
from shared.replies import str_keys

MAX_STEPS = 20_000       # finalized steps read per frame, at most
MAX_OUT_ENTRIES = 5_000  # output-stream entries read per api-server per frame, at most
BAR_WIDTH = 10


async def _window_steps(r: Any, keys: K.Keys, window_s: float, now: float) -> list[dict[str, Any]]:
    snaps = await read_steps(r, keys, MAX_STEPS)
    return [s for s in snaps if s["t"] >= now - window_s]


async def _ttft_samples(r: Any, keys: K.Keys, window_s: float, now: float) -> list[float]:
    """Seconds from api-server acceptance to the engine's first token, for requests whose
    first token was emitted in the window."""
    first: dict[str, float] = {}
    start = f"{int((now - window_s) * 1000)}-0"
    out_streams = [k async for k in r.scan_iter(match=f"{keys.out('*')}", count=1000, _type="stream")]
    for stream in out_streams:
        entries = await r.xrevrange(stream, min=start, count=MAX_OUT_ENTRIES)
        for _, eid, doc in decode_entries([(stream, entries)]):
            t = entry_id_key(eid)[0] / 1000.0
            for d in doc.get("ds", ()):
                if d.get("o") == 0 and d.get("t"):
                    rid = d.get("id")
                    if rid and (rid not in first or t < first[rid]):
                        first[rid] = t
    if not first:
        return []
    ids = list(first)
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(keys.req(rid), "t_arrival")
    arrivals = await pipe.execute()
    return [first[rid] - float(a) for rid, a in zip(ids, arrivals) if a is not None and first[rid] >= float(a)]


def _round(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)


def measures_of(snaps: list[dict[str, Any]], window_s: float) -> dict[str, Any]:
    """Balance ratio, idle fraction, step rate and per-rank means over the window's steps."""
    from shared.measures import balance_ratio, idle_forward_fraction
    from shared.stats import is_pause_report

    snaps = [s for s in snaps if not all(is_pause_report(st) for st in s["ranks"].values())]   # steps only
    ranks = sorted({int(r) for s in snaps for r in s["ranks"]})
    col = {r: i for i, r in enumerate(ranks)}
    sched = [[0] * len(ranks) for _ in snaps]
    idle = [[False] * len(ranks) for _ in snaps]
    for i, s in enumerate(snaps):
        for r, st in s["ranks"].items():
            sched[i][col[int(r)]] = int(st.get("scheduled", 0))
            idle[i][col[int(r)]] = bool(st.get("idle", False))
    per_rank = {r: round(sum(row[col[r]] for row in sched) / len(sched), 2) for r in ranks} if snaps else {}
    return {
        "steps": len(snaps), "window_s": window_s, "step_rate": round(len(snaps) / window_s, 3) if window_s else 0.0,
        "balance_ratio": _round(balance_ratio(sched), 4),
        "idle_forward_fraction": _round(idle_forward_fraction(sched, idle), 4),
        "work_steps": sum(1 for row in sched if max(row, default=0) > 0),
        "scheduled_mean_per_rank": per_rank,
    }


async def collect_frame(url: str, namespace: str, window_s: float) -> dict[str, Any]:
    from services.admin.status import collect
    from shared.bus import connect
    from shared.measures import percentiles

    keys = K.Keys(namespace)
    base = await collect(url, namespace)
    now = time.time()
    r = connect(url, timeout_s=5.0)
    try:
        snaps = await _window_steps(r, keys, window_s, now)
        ttft = await _ttft_samples(r, keys, window_s, now)
        queues = await request_queue(r, keys)
    finally:
        await r.aclose()
    m = measures_of(snaps, window_s)
    pct = {k: (round(v * 1000, 2) if v == v else None) for k, v in percentiles(ttft).items()}
    queues["inbox_pending"] = sum(rk["inbox_pending"] for rk in base["ranks"])
    counters = base["scheduler"].get("counters", {})
    queues["unplaced"] = counters.get("policy_unplaced", 0) if isinstance(counters.get("policy_unplaced"), int) else 0
    return {**base, "t": now, "measures": m, "ttft_ms": {**pct, "n": len(ttft)}, "queues": queues}


# ---------------------------------------------------------------------------- render
def _bar(value: float, full: float, width: int = BAR_WIDTH) -> str:
    if full <= 0:
        return " " * width
    n = max(0, min(width, round(width * value / full)))
    return "█" * n + "·" * (width - n)


def _fmt(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def render_frame(data: dict[str, Any]) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    c, m, q, tt = data["cluster"], data["measures"], data["queues"], data["ttft_ms"]
    head = Text.assemble(
        (f"lockstep [{data['namespace']}]", "bold"),
        f"  {c.get('ranks', '?')} ranks ({c.get('backend', '?')}), {c.get('api_servers', '?')} api-servers, "
        f"policy {c.get('policy', '?')}, leader {data['scheduler'].get('leader') or 'NONE'}   "
        + time.strftime("%H:%M:%S", time.localtime(data["t"])))
    ranks = data["ranks"]
    sched_mean = m["scheduled_mean_per_rank"]
    top_sched = max([*(float(v) for v in sched_mean.values()), 1.0])
    top_run = max([r["running"] for r in ranks] + [1])
    top_wait = max([r["waiting"] for r in ranks] + [1])
    t = Table(title=f"per rank: tokens/step over the last {m['window_s']:g}s, the rest as of the last step",
              title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), expand=False)
    for col in ("rank", "tok/step", "running", "waiting", "KV", "idle fwd", "inbox"):
        t.add_column(col, justify="right" if col in ("idle fwd", "inbox") else "left", no_wrap=True)
    drained = set(data.get("drained", []))
    for r in ranks:
        state = (" [red]dead[/red]" if not r["alive"] else " [yellow]drained[/yellow]" if r["rank"] in drained
                 else "")
        s = float(sched_mean.get(r["rank"], 0.0))
        kv_frac = r["kv_used"] / r["kv_total"] if r["kv_total"] else 0.0
        t.add_row(f"{r['rank']}{state}",
                  f"{_bar(s, top_sched, 8)} {s:.1f}",
                  f"{_bar(r['running'], top_run, 5)} {r['running']}",
                  f"{_bar(r['waiting'], top_wait, 5)} {r['waiting']}",
                  f"{_bar(kv_frac, 1.0, 5)} {kv_frac * 100:.0f}%",
                  str(r["idle_forwards"]), str(r["inbox_pending"]))
    br, snap = m["balance_ratio"], data["snapshot"]
    stats = Text.from_markup("\n".join([
        f"step rate [bold]{m['step_rate']:.1f}/s[/bold] ({m['steps']} steps, {m['work_steps']} with work)   "
        f"balance ratio [bold]{_fmt(br, '.3f')}[/bold]",
        f"idle-forward fraction [bold]{_fmt(m['idle_forward_fraction'], '.3f')}[/bold]   "
        f"dispatched {data['scheduler'].get('counters', {}).get('dispatched', 0)}",
        f"TTFT ms p50 [bold]{_fmt(tt['p50'], '.1f')}[/bold]  p90 {_fmt(tt['p90'], '.1f')}  "
        f"p99 {_fmt(tt['p99'], '.1f')}  (n={tt['n']})",
        f"queues: requests stream {q['requests_len']} (unread {q['scheduler_lag']}, unacked {q['scheduler_pending']})"
        f"   unplaced in the scheduler {q['unplaced']}",
        f"rank inboxes unacked {q['inbox_pending']}   "
        + (f"snapshot wave {snap['wave']} step {snap['step']} ({snap['age_s']:.1f}s ago)" if snap else "no snapshot yet"),
    ]))
    return Group(head, t, stats)


def watch_cmd(interval: float = typer.Option(1.0, "--interval", "-i", min=0.1, help="Seconds between frames."),
              window: float = typer.Option(10.0, "--window", "-w", min=0.5,
                                           help="Seconds of history behind the rates and measures."),
              once: bool = typer.Option(False, "--once", help="Render one frame and exit."),
              namespace: str = NS_OPT, redis_url: Optional[str] = URL_OPT, json: bool = JSON_OPT) -> None:
    """Live dashboard: per-rank load bars, step rate, balance ratio, idle-forward fraction, queues, TTFT."""
    url = resolve(redis_url, namespace)
    require_cluster(url, namespace)
    if json:
        emit_json(asyncio.run(collect_frame(url, namespace, window)))
        return
    from rich.live import Live

    console = out_console()
    if once:
        console.print(render_frame(asyncio.run(collect_frame(url, namespace, window))))
        return

    async def plain() -> None:
        # Not a terminal (`watch | tee`, a CI log): a live view writes nothing until it ends,
        # so each frame is printed whole, one after another
        while True:
            try:
                console.print(render_frame(await collect_frame(url, namespace, window)))
            except Exception as exc:  # noqa: BLE001 - keep going through a blip
                console.print(f"lockstep watch: {exc.__class__.__name__}: {exc} (retrying)")
            console.file.flush()
            await asyncio.sleep(interval)

    async def loop() -> None:
        frame = await collect_frame(url, namespace, window)
        with Live(render_frame(frame), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                await asyncio.sleep(interval)
                try:
                    frame = await collect_frame(url, namespace, window)
                except Exception as exc:  # noqa: BLE001 - keep the dashboard up through a blip
                    from rich.text import Text
                    live.update(Text(f"lockstep watch: {exc.__class__.__name__}: {exc} (retrying)", style="red"))
                    continue
                live.update(render_frame(frame))

    try:
        asyncio.run(loop() if console.is_terminal else plain())
    except KeyboardInterrupt:
        pass


def register(app: typer.Typer) -> None:
    app.command("watch")(watch_cmd)
