"""One response from several engine requests: ``n`` > 1, ``best_of`` and batched prompts.

Choice ``index`` is ``prompt_number * n + j`` (vLLM's). Each choice is its own engine
request (id ``<response id>-<prompt>-<j>``), so the choices of one response spread over
ranks like any other requests; a ``seed`` gives choice j the seed ``seed + j`` (the
sampler's draws depend on (seed, position), so equal seeds would give equal choices).
``best_of`` candidates are ranked by their cumulative logprob (the sampler's, asked for
internally when the client did not ask), the n best returned. ``usage`` sums the prompt
tokens of each prompt once and the completion tokens of the returned choices.
"""

from __future__ import annotations

import asyncio
import time
from copy import copy
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson
from starlette.responses import Response, StreamingResponse

from services.api_server.choice import StreamChoice, final, with_reasoning
from services.api_server.admission import admit, not_completed, ran_out
from services.api_server.errors import ApiError
from services.api_server.gateway import Gateway, RequestChannel
from services.api_server.protocol import ParsedRequest
from shared.messages import Request


@dataclass(slots=True)
class Sub:
    rid: str
    prompt_no: int
    j: int                     # candidate number within its prompt
    prompt: list[int]
    text: str
    ch: RequestChannel | None = None


def plan(p: ParsedRequest, rid: str) -> list[Sub]:
    """The engine requests that answer ``p`` (pure)."""
    prompts = p.prompts or [(p.prompt, p.prompt_text)]
    return [Sub(f"{rid}-{i}-{j}", i, j, toks, text) for i, (toks, text) in enumerate(prompts)
            for j in range(p.best_of)]


def sub_params(p: ParsedRequest, j: int):
    params = copy(p.params)
    if params.seed is not None:
        params.seed = params.seed + j
    return params


def score(ch: RequestChannel) -> float:
    """A best_of candidate's cumulative logprob (a token without one counts 0)."""
    return sum(e[0] for e in (ch.logprobs or ()) if e is not None)


def pick(p: ParsedRequest, subs: list[Sub]) -> list[tuple[int, Sub]]:
    """(choice index, sub) of the returned choices: per prompt, the n best candidates."""
    out: list[tuple[int, Sub]] = []
    by_prompt: dict[int, list[Sub]] = {}
    for s in subs:
        by_prompt.setdefault(s.prompt_no, []).append(s)
    for i, cands in sorted(by_prompt.items()):
        if p.best_of > p.n:
            cands = sorted(cands, key=lambda s: -score(s.ch))[:p.n]   # stable: ties keep candidate order
        out += [(i * p.n + k, s) for k, s in enumerate(cands)]
    return out


def usage(p: ParsedRequest, chosen: list[tuple[int, Sub]], subs: list[Sub]) -> dict[str, Any]:
    pt = sum({s.prompt_no: s.ch.prompt_tokens or len(s.prompt) for s in subs}.values())
    ct = 0 if p.drop_output else sum(len(s.ch.tokens) for _, s in chosen)
    return with_reasoning(p, {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
                          sum(s.ch.reasoning_tokens for _, s in chosen))


def _visible(p: ParsedRequest) -> ParsedRequest:
    """``p`` as its choices are shown: logprobs asked only to rank candidates are hidden."""
    if not p.best_of_lp:
        return p
    q = copy(p)
    q.logprobs = None
    return q


async def run_multi(request: Any, p: ParsedRequest, gw: Gateway, rid: str, api_id: str, settings: Any,
                    metrics: Any) -> Response:
    subs = plan(p, rid)
    try:
        admit(gw, settings, len(subs), tokens=sum(len(s.prompt) for s in subs))
    except ApiError:
        metrics.rejected.inc()
        raise
    now = time.time()
    for s in subs:
        req = Request(id=s.rid, api=api_id, prompt=s.prompt, params=sub_params(p, s.j), arrival=now, rank=p.rank)
        metrics.prompt_tokens.inc(len(s.prompt))
        s.ch = gw.submit(req)
    await asyncio.sleep(0)   # the gateway puts them on the wire first
    created = int(now)
    if p.stream:
        return StreamingResponse(_sse(request, p, subs, gw, rid, created, settings, metrics),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(request, p, subs, gw, rid, created, settings, metrics)


def _end(gw: Gateway, subs: list[Sub], reason: str | None) -> None:
    """Release every sub; abort those still running when the response ends early."""
    for s in subs:
        if reason is not None and s.ch.finish is None:
            gw.abort(s.rid, reason)
        else:
            gw.release(s.rid)


async def _wait(event: asyncio.Event, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    async with asyncio.timeout(left):
        await event.wait()
    event.clear()


async def _client_gone(request: Any) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _complete(request: Any, p: ParsedRequest, subs: list[Sub], gw: Gateway, rid: str, created: int,
                    settings: Any, metrics: Any) -> Response:
    t0 = time.monotonic()
    deadline = t0 + settings.request_timeout_s
    metrics.inflight.inc()
    disconnected = asyncio.ensure_future(_client_gone(request))
    reason: str | None = None
    try:
        for s in subs:
            while s.ch.finish is None:
                waiter = asyncio.ensure_future(_wait(s.ch.event, gw.until(deadline)))
                done, _ = await asyncio.wait({waiter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if disconnected in done:
                    waiter.cancel()
                    metrics.aborts.labels("client_disconnected").inc()
                    reason = "client_disconnected"
                    return Response(status_code=499)
                try:
                    waiter.result()
                except TimeoutError:
                    reason, err = ran_out(gw, settings.request_timeout_s)
                    metrics.aborts.labels(reason).inc()
                    raise err from None
    finally:
        disconnected.cancel()
        metrics.inflight.dec()
        _end(gw, subs, reason)
    bad = next((s for s in subs if s.ch.finish in ("error", "abort")), None)
    if bad is not None:
        raise not_completed(bad.ch)
    chosen = pick(p, subs)
    shown = _visible(p)
    done_t = time.monotonic()
    for s in subs:
        metrics.request_done(s.ch, t0, done_t)
    choices = [final(shown, s.ch, idx, s.prompt, s.text) for idx, s in chosen]
    body: dict[str, Any] = {"id": rid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                            "created": created, "model": p.model, "choices": choices,
                            "usage": usage(p, chosen, subs)}
    if p.kind == "chat":
        body["system_fingerprint"] = None
        if p.return_token_ids:
            body["prompt_token_ids"] = list(subs[0].prompt)
        if p.prompt_logprobs is not None:         # vLLM puts chat's on the response (one prompt)
            body["prompt_logprobs"] = choices[0].get("prompt_logprobs")
            for c in choices:
                c.pop("prompt_logprobs", None)
    return Response(orjson.dumps(body), media_type="application/json")


async def _sse(request: Any, p: ParsedRequest, subs: list[Sub], gw: Gateway, rid: str, created: int,
               settings: Any, metrics: Any) -> AsyncIterator[bytes]:
    """Streamed: best_of == n here (the parser refuses more), every sub is a choice."""
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    extra = {"usage": None} if p.include_usage else {}
    event = asyncio.Event()             # one wake-up for all the choices' channels
    for s in subs:
        s.ch.event = event
    streams = [StreamChoice(p, s.ch, idx, s.prompt, s.text) for idx, s in pick(p, subs)]
    t0 = time.monotonic()
    deadline = t0 + settings.request_timeout_s
    reason: str | None = "client_disconnected"
    metrics.inflight.inc()

    prompt_ids = {"prompt_token_ids": list(subs[0].prompt)} if p.kind == "chat" and p.return_token_ids else {}

    def chunk(st: StreamChoice, entries: list[dict[str, Any]]) -> bytes:
        nonlocal prompt_ids
        if p.continuous_usage:       # this chunk's choice: its prompt and its tokens so far, as vLLM counts
            pt = len(st.prompt)
            ct = 0 if p.drop_output else st.sent
            extra["usage"] = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
        head, prompt_ids = prompt_ids, {}     # chat's prompt ids: on the first chunk (vLLM's)
        return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": p.model,
                                         "choices": entries, **head, **extra}) + b"\n\n"
    try:
        while True:
            for st in streams:
                entries = st.poll()
                for e in entries:        # one choice per chunk, as vLLM streams them
                    yield chunk(st, [e])
            broken = next((s for s in subs if s.ch.finish in ("error", "abort")), None)
            if broken is not None:
                reason = "engine_error"
                yield b"data: " + orjson.dumps(not_completed(broken.ch).body()) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            if all(st.done for st in streams):
                reason = None
                if p.include_usage:
                    yield b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": p.model,
                                                    "choices": [], "usage": usage(p, pick(p, subs), subs)}) + b"\n\n"
                yield b"data: [DONE]\n\n"
                done_t = time.monotonic()
                for s in subs:
                    metrics.request_done(s.ch, t0, done_t)
                return
            try:
                await _wait(event, gw.until(deadline))
            except TimeoutError:   # say why, then end the stream cleanly
                reason, err = ran_out(gw, settings.request_timeout_s)
                metrics.aborts.labels(reason).inc()
                yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
    finally:
        metrics.inflight.dec()
        if reason == "client_disconnected":
            metrics.aborts.labels("client_disconnected").inc()
        _end(gw, subs, reason)
