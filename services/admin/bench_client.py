"""The HTTP side of ``lockstep bench``: one streaming ``/v1/completions`` request timed from
the client (TTFT, gaps between content chunks, end to end), and sending a trace's requests
at their arrival times."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from services.admin.bench_trace import Item, prompt_text

WARM_CONNECTIONS = 64        # connections opened (GET /v1/models) before the run starts


def base_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


async def served_model(client: Any, base: str) -> tuple[str, int]:
    resp = await client.get(base + "/models")
    resp.raise_for_status()
    m = resp.json()["data"][0]
    return m["id"], int(m.get("max_model_len") or 4096)


@dataclass(slots=True)
class Result:
    i: int
    ok: bool = False
    id: str = ""
    sent: float = 0.0           # perf_counter at send
    sent_wall: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    done: float = 0.0           # perf_counter at the last byte
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    status: int = 0             # the HTTP status (0: no response)


def stream_complete(done_marker: bool, tokens: int, asked: int) -> bool:
    """Whether a benchmark stream completed: it ended with ``[DONE]`` and its usage counts
    every token asked (the bench sends ``ignore_eos``)."""
    return done_marker and tokens == asked


async def stream_one(client: Any, base: str, model: str, it: Item, i: int) -> Result:
    res = Result(i)
    body = {"model": model, "prompt": prompt_text(it.prompt_tokens, i), "max_tokens": it.output_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    res.sent, res.sent_wall = time.perf_counter(), time.time()
    last, finished = 0.0, False
    try:
        async with client.stream("POST", base + "/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {raw[:200].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    finished = True
                    break
                doc = json.loads(data)
                if "error" in doc:
                    res.error = str(doc["error"].get("message", doc["error"]))
                    return res
                res.id = res.id or doc.get("id", "")
                if doc.get("usage"):
                    res.tokens = int(doc["usage"].get("completion_tokens", 0))
                choices = doc.get("choices") or ()
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.sent
                    else:
                        res.gaps.append(now - last)
                    last = now
        res.done = time.perf_counter()
        res.e2e = res.done - res.sent
        # a stream cut before [DONE], or short of the tokens asked (ignore_eos: all of
        # them), did not complete: it must not count as a completed request
        res.ok = stream_complete(finished, res.tokens, it.output_tokens)
        if not res.ok:
            res.error = ("the stream ended without [DONE]" if not finished else
                         f"the stream ended after {res.tokens} of {it.output_tokens} tokens")
    except Exception as exc:  # noqa: BLE001 - one failed request is a figure, not a crash
        res.error = f"{exc.__class__.__name__}: {exc}"
    return res


async def drive(client: Any, base: str, model: str, items: list[Item], progress: bool) -> list[Result]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, disable=not (progress and console.is_terminal),
                   transient=False)
    with bar:
        sent_t = bar.add_task("sent", total=len(items))
        done_t = bar.add_task("done", total=len(items))
        tasks: list[asyncio.Task] = []

        async def one(it: Item, i: int) -> Result:
            res = await stream_one(client, base, model, it, i)
            bar.advance(done_t)
            return res

        t0 = time.perf_counter()
        try:
            for i, it in enumerate(items):
                delay = t0 + it.t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(it, i)))
                bar.advance(sent_t)
            return list(await asyncio.gather(*tasks))
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.run cancels the run): the requests in flight are dropped (their
            # streams closed, so the cluster aborts them) and the run reports what finished.
            # A second Ctrl-C stops at once.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            raise Interrupted([t.result() for t in tasks if not t.cancelled() and t.exception() is None]) from None


class Interrupted(Exception):
    """The run was stopped (Ctrl-C) before every request finished: those that did."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__(f"interrupted after {len(results)} finished requests")
        self.results = results
