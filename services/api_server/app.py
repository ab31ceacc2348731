"""The api-server's HTTP face: OpenAI-compatible completions and chat over the gateway."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request as HttpRequest
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from services.api_server.admission import admission_view, admit, not_completed, ran_out
from services.api_server.errors import ApiError, error_response
from services.api_server.gateway import Gateway, RequestChannel, client_policy
from services.api_server.choice import feed as _feed, final, prompt_part, text_tokens as _text_tokens, with_reasoning
from services.api_server.logprobs import CompletionLogprobs, chat_logprobs, names_for
from services.api_server.multi import run_multi
from services.api_server.metrics import ApiMetrics, unplaced
from services.api_server import hf_text, responses_api
from services.api_server.bodies import add_components, openapi_body
from services.api_server.protocol import (CHAT_TEMPLATE, SPECIAL_TOKENS, ParsedRequest, parse, parse_detokenize,
                                         parse_tokenize, token_str)
from shared import keys as K
from shared.bus import connect
from shared.logging import configure
from shared.messages import Request
from shared.settings import ApiServerSettings
from shared.stop import TextStopper
from shared.tokenizer import BOS, EOS, VOCAB_SIZE
from shared import reasoning
from shared import tokenizer as _bytes
from shared import trace
from shared.hf_tokenizer import HFTokenizer

def _version() -> str:
    try:
        return importlib.metadata.version("lockstep")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


VERSION = _version()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SUBMIT_WAIT_S = 2.0   # a stream's 200 waits at most this for its submission's write (one Redis round trip)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class BodyLimit:
    """Pure ASGI middleware: refuse bodies over the limit with 413 before reading them all."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._too_large(scope, receive, send)
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                # (a gzip body was read as JSON: "invalid character (byte 0)")
                resp = error_response(415, f"request bodies with Content-Encoding: {value.decode('latin-1')} are not "
                                           "supported: send the JSON uncompressed", code="unsupported_media_type")
                return await resp(scope, receive, send)
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise ApiError(413, f"request body over {self.limit} bytes; send a smaller prompt",
                                   code="request_too_large")
            return msg

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        resp = error_response(413, f"request body over {self.limit} bytes; send a smaller prompt",
                              code="request_too_large")
        await resp(scope, receive, send)


class RequestIdHeader:
    """Pure ASGI middleware: every response carries ``X-Request-Id`` — the client's own
    (vLLM's and most proxies' correlation header) where it sent a usable one, else, on a
    generation request, the id of its completion (``id`` in the body), so a log line, a
    trace and a client's report name the same request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.begin_close: Callable[[], None] = lambda: None   # what the server calls as shutdown begins (create_app's)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = scope[SCOPE_CLIENT_RID] = client_request_id(scope)   # read once: the handler logs it too

        async def send_with_id(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                value = given or scope.get(SCOPE_RID)
                if value is not None:
                    msg["headers"] = [*msg.get("headers", ()), (b"x-request-id", value.encode())]
            await send(msg)

        await self.app(scope, receive, send_with_id)


# OpenAI's and vLLM's routes for other kinds of models (a client pointed here for them gets
# a 404 that says what this server is, not "no route")
_OTHER_APIS = (("/v1/embeddings", "embeddings"), ("/v1/audio", "audio"), ("/v1/images", "images"),
               ("/v1/moderations", "moderations"), ("/pooling", "pooling"), ("/classify", "classification"),
               ("/score", "scoring"), ("/v1/score", "scoring"), ("/rerank", "reranking"),
               ("/v1/rerank", "reranking"), ("/v2/rerank", "reranking"))

SCOPE_RID = "lockstep.request_id"   # where the generation handler leaves its completion's id
SCOPE_CLIENT_RID = "lockstep.client_request_id"   # the client's usable X-Request-Id (RequestIdHeader), or None


def client_request_id(scope: dict) -> str | None:
    """The client's X-Request-Id, if it is one header line of at most 256 visible ASCII
    characters (anything else is not echoed: it could split or bloat the response)."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            if 0 < len(value) <= 256 and all(0x21 <= c <= 0x7E for c in value):
                return value.decode()
            return None
    return None


def _internal_error(log: Any, exc: Exception) -> Response:
    log.error("unhandled_error", error=repr(exc))
    return error_response(500, "internal error; the request was not completed")


class HotPaths:
    """Pure ASGI front: the generation endpoints go straight to their handler, past
    FastAPI's routing, dependency and exception layers (a third of the api-server's CPU
    per request under load). Everything else, and the OpenAPI description of these two,
    stays with FastAPI."""

    def __init__(self, app: FastAPI, routes: dict[str, Any], log: Any) -> None:
        self.app, self.routes, self.log = app, routes, log

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
            if handler is not None:
                try:
                    response = await handler(HttpRequest(scope, receive))
                except Exception as exc:  # noqa: BLE001 - as FastAPI's 500 handler does
                    response = _internal_error(self.log, exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: ApiServerSettings, metrics_dir: str | None = None) -> Any:
    """The api-server's ASGI application (body limit, hot paths, then FastAPI)."""
    # One id per process incarnation: a restarted replica must not inherit the requests of
    # the one that died (engines abort those when its heartbeat stops).
    api_id = f"{settings.api_id or 'api'}-{uuid.uuid4().hex[:6]}"
    log = configure("api-server", settings.log_level, api=api_id)
    metrics = ApiMetrics(settings.model, metrics_dir)   # metrics_dir: shared by the port's replicas
    warned: set[str] = set()   # unknown request fields already logged (once per name per process)
    keys = K.Keys(settings.namespace)
    state: dict[str, Any] = {}
    # A checkpoint directory as the model: its own tokenizer and chat template, served
    # under the directory's name (issue #16); else the byte tokenizer.
    ckpt = hf_text.checkpoint_dir(settings.model)
    tok = HFTokenizer(ckpt) if ckpt else None
    if ckpt:
        # gpt-oss speaks harmony: its channels are told apart unless a parser was named
        parser = settings.reasoning_parser or reasoning.default_parser(hf_text.model_type(ckpt))
        settings = settings.model_copy(update={"model": Path(ckpt).name, "reasoning_parser": parser})
        _ = tok.grammar_vocab   # built now, not inside the first structured-output request
        if settings.generation_config == "none":
            tok.sampling_defaults = {}
        elif tok.sampling_defaults:
            log.info("sampling_defaults_from_checkpoint", source=str(Path(ckpt) / "generation_config.json"),
                     **tok.sampling_defaults, hint="a request's own values win; LOCKSTEP_GENERATION_CONFIG=none "
                                                   "for OpenAI's defaults")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r = connect(settings.redis_url)
        policy = client_policy(settings, api_id)
        gw = Gateway(r, keys, api_id, dispatch=settings.dispatch, policy=policy, log=log, metrics=metrics,
                     engine_down_timeout_s=settings.engine_down_timeout_s, redis_url=settings.redis_url,
                     replicas=settings.num_api_servers)
        await gw.start()
        state["gw"], state["r"], state["loop"] = gw, r, asyncio.get_running_loop()
        log.info("api_server_ready", port=settings.port, dispatch=settings.dispatch, ranks=gw.num_ranks)
        try:
            yield
        finally:
            await gw.stop()
            await r.aclose()

    app = FastAPI(title="lockstep api-server", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(404)
    async def _not_found(request: HttpRequest, _: Exception) -> Response:
        path = request.url.path.rstrip("/")
        other = next((what for prefix, what in _OTHER_APIS if path == prefix or path.startswith(prefix + "/")), None)
        if other is not None:   # an API of another kind of model: say so, and what is served
            return error_response(404, f"{path} ({other}) is not served here: lockstep serves a generative model "
                                       "through /v1/completions, /v1/chat/completions and /v1/responses",
                                  code="not_found", error_type="invalid_request_error")
        return error_response(404, f"no route {request.method} {request.url.path}", code="not_found",
                              error_type="invalid_request_error")   # OpenAI's type for an unknown URL

    @app.exception_handler(405)
    async def _bad_method(request: HttpRequest, exc: Exception) -> Response:
        allow = dict(getattr(exc, "headers", None) or {})   # the methods it takes (HTTP requires Allow)
        return error_response(405, f"method {request.method} not allowed on {request.url.path}",
                              code="method_not_allowed", headers=allow or None)

    @app.exception_handler(Exception)
    async def _crash(_: HttpRequest, exc: Exception) -> Response:
        return _internal_error(log, exc)

    def check_auth(request: HttpRequest) -> None:
        if not settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not token or not any(hmac.compare_digest(token, k) for k in settings.api_keys):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    # HEAD too on the probes and listings (wget --spider and some load balancers send HEAD)
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        gw: Gateway = state["gw"]
        try:
            await asyncio.wait_for(state["r"].ping(), 1.0)
        except Exception:  # noqa: BLE001
            return _json({"status": "unhealthy", "redis": False, "api_id": api_id}, 503)
        return _json({"status": "ok", "redis": True, "api_id": api_id, "inflight": len(gw.channels),
                      "ranks": gw.num_ranks, "ranks_live": gw.ranks_live, "admission": admission_view(gw)})

    @app.api_route("/ready", methods=["GET", "HEAD"])
    async def ready() -> Response:
        """Readiness (a load balancer's or Kubernetes' probe): 200 only while a request would be
        served now: Redis answers and every rank of the engine group has a heartbeat (it steps
        only with all of them). ``/health`` stays liveness: this process and its Redis."""
        gw: Gateway = state["gw"]
        try:
            await asyncio.wait_for(state["r"].ping(), 1.0)
        except Exception:  # noqa: BLE001
            return _json({"status": "unready", "reason": "redis_unavailable", "api_id": api_id}, 503)
        if gw.redis_refusal:   # it answers reads but refused this replica's last write (full, or paused)
            return _json({"status": "unready", "reason": "redis_unavailable", "api_id": api_id,
                          "message": f"{gw.redis_refusal}: new requests cannot be queued"}, 503)
        body = {"api_id": api_id, "ranks": gw.num_ranks, "ranks_live": gw.ranks_live}
        if gw.ranks_live is None or gw.ranks_live < gw.num_ranks:
            return _json({"status": "unready", "reason": "engine_group_incomplete", **body,
                          "message": f"{gw.ranks_live or 0} of the engine group's {gw.num_ranks} ranks have a "
                                     f"heartbeat; it steps only with all of them "
                                     f"(`{K.admin_command('status', keys.ns)}` shows which)"}, 503)
        return _json({"status": "ready", **body})

    @app.get("/metrics")
    async def prom() -> Response:
        gw = state.get("gw")
        if gw is not None and not gw.client_dispatch:
            try:   # the ranks' view and the scheduler's stream (both in vllm:num_requests_waiting)
                _, n = await asyncio.wait_for(asyncio.gather(gw.refresh_snapshot(), unplaced(state["r"], keys)), 1.0)
                metrics.observe_unplaced(n)
            except Exception:  # noqa: BLE001 - metrics still served, without a fresh view
                pass
        if gw is not None:
            metrics.observe_group(gw.num_ranks, gw.ranks_live)
        if gw is not None and gw.policy is not None:
            metrics.observe_policy(gw.policy)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    started = int(time.time())   # a model card's "created": when this replica began serving it

    def model_card() -> dict[str, Any]:
        return {"id": settings.model, "object": "model", "created": started, "owned_by": "lockstep",
                "root": settings.model, "parent": None, "max_model_len": settings.max_model_len}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: HttpRequest) -> Response:
        check_auth(request)
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: HttpRequest, model_id: str) -> Response:
        check_auth(request)
        if model_id != settings.model:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{settings.model}'",
                           param="model", code="model_not_found",
                           error_type="invalid_request_error")   # OpenAI's type for it
        return _json(model_card())

    @app.api_route("/ping", methods=["GET", "POST", "HEAD"])
    async def ping() -> Response:
        """SageMaker's liveness probe, as vLLM serves it: 200 with an empty body."""
        return Response(status_code=200)

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> Response:
        return _json({"version": VERSION})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        if tok is not None:
            return _json(hf_text.tokenizer_info(tok, settings.max_model_len))
        return _json({"tokenizer_class": "ByteLevelTokenizer", "vocab_size": VOCAB_SIZE,
                      "model_max_length": settings.max_model_len, "eos_token": SPECIAL_TOKENS[EOS],
                      "eos_token_id": EOS, "bos_token": SPECIAL_TOKENS[BOS], "bos_token_id": BOS,
                      "add_bos_token": False, "add_eos_token": False, "pad_token": None, "unk_token": None,
                      "chat_template": CHAT_TEMPLATE,
                      "description": "each UTF-8 byte is one token (ids 0..255); ids 256.. are special"})

    @app.post("/tokenize", openapi_extra=openapi_body("TokenizeBody"))
    async def tokenize(request: HttpRequest) -> Response:
        check_auth(request)
        tokens, strs = parse_tokenize(await request.body(), settings.model, tok)
        return _json({"count": len(tokens), "max_model_len": settings.max_model_len, "tokens": tokens,
                      "token_strs": [tok.token_str(t) if tok else token_str(t) for t in tokens] if strs else None})

    @app.post("/detokenize", openapi_extra=openapi_body("DetokenizeBody"))
    async def detokenize(request: HttpRequest) -> Response:
        check_auth(request)
        return _json({"prompt": (tok or _bytes).decode(parse_detokenize(await request.body(), settings.model, tok))})

    async def handle(request: HttpRequest, kind: str, responses: bool = False) -> Response:
        """/v1/completions, /v1/chat/completions, and (``responses``) /v1/responses, which
        runs as the chat request it translates to (responses_api.py)."""
        endpoint = "responses" if responses else "chat" if kind == "chat" else "completions"
        if trace.ENABLED:
            trace.mark("http_in")
        try:
            check_auth(request)
            try:
                async with asyncio.timeout(settings.read_timeout_s):
                    raw = await request.body()
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {settings.read_timeout_s:g} s "
                               "(read_timeout_s); send it again", code="request_timeout",
                               headers={"Connection": "close"}) from None
            translated = None
            if responses:
                raw, translated = responses_api.to_chat(raw)
            gw: Gateway = state["gw"]
            try:
                parsed = parse(raw, kind, served_model=settings.model, max_model_len=settings.max_model_len,
                               num_ranks=gw.num_ranks, header_rank=request.headers.get("x-data-parallel-rank"),
                               tok=tok, reasoning_parser=settings.reasoning_parser)
            except ApiError as exc:
                raise exc if translated is None else responses_api.rename_error(exc, translated) from None
            if translated is not None and translated.ignored:
                parsed.ignored = (*parsed.ignored, *translated.ignored)
            if parsed.ignored and len(warned) < 256 and not warned.issuperset(parsed.ignored):
                new = sorted(set(parsed.ignored) - warned)
                warned.update(new)
                log.warning("unknown_fields_ignored", fields=new, endpoint=endpoint)
            if not parsed.multi:   # (run_multi checks its n choices itself)
                try:
                    admit(gw, settings, tokens=len(parsed.prompt))
                except ApiError:
                    metrics.rejected.inc()
                    raise
            resp = await _run(request, parsed, gw, None if translated is None else translated.id)
            if translated is not None:
                resp = _as_responses(resp, translated, parsed.model)
        except ApiError as exc:
            metrics.requests.labels(endpoint, str(exc.status)).inc()
            return exc.response()
        except ClientDisconnect:   # gone before its body was whole: nothing to answer (it was a logged 500)
            metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    def _as_responses(resp: Response, t: responses_api.Translated, model: str) -> Response:
        """A chat answer as the Responses API's: the response object, or its event stream."""
        if isinstance(resp, StreamingResponse):
            return StreamingResponse(_events(resp.body_iterator, t, model), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        if resp.status_code != 200:
            return resp
        return _json(responses_api.from_chat(orjson.loads(resp.body), t))

    async def _events(chunks: Any, t: responses_api.Translated, model: str) -> AsyncIterator[bytes]:
        try:
            async for block in chunks:
                for part in block.split(b"\n\n"):
                    if part.startswith(b"data: ") and part != b"data: [DONE]":
                        for event in responses_api.stream_events(orjson.loads(part[6:]), t, model):
                            yield event
        finally:
            await chunks.aclose()   # the chat stream's own end: a client gone aborts the request there

    async def _run(request: HttpRequest, p: ParsedRequest, gw: Gateway, rid: str | None = None) -> Response:
        prefix = "chatcmpl-" if p.kind == "chat" else "cmpl-"
        rid = rid or prefix + uuid.uuid4().hex
        request.scope[SCOPE_RID] = rid   # the X-Request-Id of the response where the client sent none
        if p.multi:
            return await run_multi(request, p, gw, rid, api_id, settings, metrics)
        now = time.time()
        req = Request(id=rid, api=api_id, prompt=p.prompt, params=p.params, arrival=now, rank=p.rank)
        metrics.prompt_tokens.inc(len(p.prompt))
        log.debug("request_accepted", request_id=rid, client_request_id=request.scope.get(SCOPE_CLIENT_RID),
                  prompt_tokens=len(p.prompt), max_tokens=p.params.max_tokens,
                  stream=p.stream, rank=p.rank)
        ch = gw.submit(req)
        # Let the gateway put the request on the wire before this task builds the response.
        await asyncio.sleep(0)
        created = int(now)
        if p.stream:
            # A stream's 200 waits for the submission's write (one round trip): a request
            # Redis did not take is a 503 before any event, as vLLM refuses what it knows
            # before generating, and the client's own retries (which stop at a 200) apply.
            try:
                async with asyncio.timeout(SUBMIT_WAIT_S):
                    await ch.sent.wait()
            except TimeoutError:
                pass   # Redis is slow to answer: the stream starts, and says what becomes of it
            if ch.finish == "error":
                gw.release(rid)
                raise not_completed(ch)
            return StreamingResponse(_sse(request, p, ch, gw, rid, created), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await _complete(request, p, ch, gw, rid, created)

    async def _wait(ch: RequestChannel, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        async with asyncio.timeout(left):   # a timeout scope, not wait_for: no task per wake-up
            await ch.event.wait()
        ch.event.clear()

    async def _complete(request: HttpRequest, p: ParsedRequest, ch: RequestChannel, gw: Gateway,
                        rid: str, created: int) -> Response:
        t0 = time.monotonic()
        deadline = t0 + settings.request_timeout_s
        metrics.inflight.inc()
        disconnected = asyncio.ensure_future(_client_gone(request))
        try:
            while ch.finish is None:
                waiter = asyncio.ensure_future(_wait(ch, gw.until(deadline)))
                done, _ = await asyncio.wait({waiter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if disconnected in done:
                    waiter.cancel()
                    metrics.aborts.labels("client_disconnected").inc()
                    gw.abort(rid)
                    return Response(status_code=499)
                try:
                    waiter.result()
                except TimeoutError:
                    reason, err = ran_out(gw, settings.request_timeout_s)
                    metrics.aborts.labels(reason).inc()
                    gw.abort(rid, reason)
                    raise err from None
        finally:
            disconnected.cancel()
            metrics.inflight.dec()
            gw.release(rid)
        if ch.finish in ("error", "abort"):
            raise not_completed(ch)
        _observe(ch, t0, len(ch.tokens))
        choice = final(p, ch, 0, p.prompt, p.prompt_text)
        if p.kind == "chat":
            body = {"id": rid, "object": "chat.completion", "created": created, "model": p.model,
                    "choices": [choice], "usage": _usage(p, ch), "system_fingerprint": None}
            if p.return_token_ids:
                body["prompt_token_ids"] = list(p.prompt)
            if "prompt_logprobs" in choice:          # vLLM puts chat's on the response
                body["prompt_logprobs"] = choice.pop("prompt_logprobs")
            return _json(body)
        return _json({"id": rid, "object": "text_completion", "created": created, "model": p.model,
                      "choices": [choice], "usage": _usage(p, ch)})

    def _usage_so_far(p: ParsedRequest, sent: int) -> dict[str, int]:
        """continuous_usage_stats: the tokens streamed so far (the prompt as billed)."""
        n = 0 if p.drop_output else sent
        return {"prompt_tokens": len(p.prompt), "completion_tokens": n, "total_tokens": len(p.prompt) + n}

    def _usage(p: ParsedRequest, ch: RequestChannel) -> dict[str, Any]:
        pt, n = ch.prompt_tokens, 0 if p.drop_output else len(ch.tokens)
        return with_reasoning(p, {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n},
                              ch.reasoning_tokens)

    def _observe(ch: RequestChannel, t0: float, n: int) -> None:
        metrics.request_done(ch, t0, time.monotonic())

    async def _sse(request: HttpRequest, p: ParsedRequest, ch: RequestChannel, gw: Gateway,
                   rid: str, created: int) -> AsyncIterator[bytes]:
        chat = p.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_null = {"usage": None} if p.include_usage else {}

        def chunk(text: str | None, finish: str | None, role: bool = False, lp: Any = None) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": p.model,
                                             "choices": [choice],
                                             **(usage_null if not p.continuous_usage else
                                                {"usage": _usage_so_far(p, sent)})}) + b"\n\n"

        t0 = time.monotonic()
        deadline = t0 + settings.request_timeout_s
        dec, stopper = p.decoder(), TextStopper(p.params.stop)
        sent = 0
        finished = False
        want_lp = p.logprobs is not None
        names = names_for(p.tok)
        cl = CompletionLogprobs(p.logprobs or 0, names=names) if want_lp and not chat else None
        echo_due = p.echo        # with logprobs, the prompt's come with the first token: wait for it
        metrics.inflight.inc()
        try:
            if chat:
                yield chunk("", None, role=True)
            elif p.echo and not want_lp:
                yield chunk(p.prompt_text, None)
                echo_due = False
            last_t = 0.0
            while True:
                if ch.finish is None:
                    try:
                        await _wait(ch, gw.until(deadline))
                    except TimeoutError:   # say why, then end the stream cleanly
                        reason, err = ran_out(gw, settings.request_timeout_s)
                        metrics.aborts.labels(reason).inc()
                        gw.abort(rid, reason)
                        finished = True
                        yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
                if echo_due and (ch.tokens or ch.finish is not None):
                    echo_due = False
                    yield chunk(p.prompt_text, None, lp=prompt_part(p.prompt, ch, cl))
                new = ch.tokens[sent:]
                lps = ch.logprobs[sent:sent + len(new)] if want_lp and ch.logprobs is not None else None
                sent += len(new)
                if p.drop_output:
                    new = []
                if new:
                    if ch.last_t and last_t:
                        metrics.observe_itl(ch.last_t - last_t)
                    last_t = ch.last_t
                    text = _feed(p, dec, stopper, _text_tokens(p, ch, new, sent), sent - len(new))
                    lp = None
                    if want_lp:
                        lp = chat_logprobs(new, lps, p.logprobs, names) if chat else cl.part(new, lps)
                    if text or lp is not None:
                        if trace.ENABLED:
                            trace.mark("sse_first")
                        yield chunk(text, None, lp=lp)
                if ch.finish is not None and sent >= len(ch.tokens):
                    finished = True
                    if ch.finish in ("error", "abort"):
                        yield b"data: " + orjson.dumps(not_completed(ch).body()) + b"\n\n"
                        yield b"data: [DONE]\n\n"
                        return
                    tail = stopper.feed(dec.flush()) + stopper.finish()
                    if tail:
                        yield chunk(tail, None)
                    yield chunk(None if chat else "", "stop" if stopper.stopped else ch.finish)
                    if p.include_usage:
                        yield b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created,
                                                        "model": p.model, "choices": [],
                                                        "usage": _usage(p, ch)}) + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    _observe(ch, t0, len(ch.tokens))
                    return
        finally:
            metrics.inflight.dec()
            if not finished:
                metrics.aborts.labels("client_disconnected").inc()
                gw.abort(rid)
            else:
                gw.release(rid)

    @app.post("/v1/completions", openapi_extra=openapi_body("CompletionBody"))
    async def completions(request: HttpRequest) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions", openapi_extra=openapi_body("ChatBody"))
    async def chat(request: HttpRequest) -> Response:
        return await handle(request, "chat")

    @app.post("/v1/responses", openapi_extra=openapi_body("ResponsesBody"))
    async def responses(request: HttpRequest) -> Response:
        return await handle(request, "chat", responses=True)

    fastapi_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or add_components(fastapi_openapi())   # the bodies' Structs
    app.state.api_id = api_id
    app.state.metrics = metrics
    hot = HotPaths(app, {"/v1/completions": lambda request: handle(request, "completion"),
                         "/v1/chat/completions": lambda request: handle(request, "chat"),
                         "/v1/responses": lambda request: handle(request, "chat", responses=True)}, log)
    limited = BodyLimit(hot, limit=settings.body_limit)
    if settings.allowed_origins:
        # Browsers' cross-origin calls (a web UI on another origin): preflights are answered
        # here, before the API key is asked for, as browsers send none with them.
        limited = CORSMiddleware(limited, allow_origins=settings.allowed_origins, allow_methods=["*"],
                                 allow_headers=["*"], expose_headers=["X-Request-Id"])
    wrapped = RequestIdHeader(limited)   # outermost: a 413 from the body limit carries the id too

    def begin_close() -> None:
        """Shutdown began (called from uvicorn's signal handler): the gateway's grace
        starts, on the loop's own turn."""
        loop, gw = state.get("loop"), state.get("gw")
        if loop is not None and gw is not None:
            loop.call_soon_threadsafe(gw.begin_close, settings.shutdown_grace_s)
    wrapped.begin_close = begin_close
    return wrapped


async def _client_gone(request: HttpRequest) -> None:
    """Completes when the client disconnects (non-streaming requests)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
