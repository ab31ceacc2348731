"""One choice of a response, from its request's channel: text through the stop-string
filter, logprobs, finish reason. Pure (no I/O); the single-request path and the
several-request one (multi.py) both build their choices with it."""

from __future__ import annotations

from typing import Any

from services.api_server import tools
from services.api_server.gateway import RequestChannel
from services.api_server.logprobs import CompletionLogprobs, chat_logprobs, join, names_for, prompt_logprobs
from services.api_server.protocol import ParsedRequest
from shared import reasoning
from shared.stop import TextStopper
from shared.tokenizer import StreamDecoder


def shown(p: ParsedRequest, ch: RequestChannel) -> list[int]:
    """The generated tokens the response shows (none for echo with max_tokens 0)."""
    return [] if p.drop_output else ch.tokens


def text_tokens(p: ParsedRequest, ch: RequestChannel, tokens: list[int], end: int | None = None) -> list[int]:
    """``tokens`` (ending at ``end`` among the generated ones) less a final stop token:
    vLLM counts it and shows it in logprobs, but not in the text."""
    end = len(ch.tokens) if end is None else end
    if (tokens and ch.finish == "stop" and end == len(ch.tokens) and p.params.stop_token_ids
            and tokens[-1] in p.params.stop_token_ids):
        return tokens[:-1]
    return tokens


def feed(p: ParsedRequest, dec: StreamDecoder, stopper: TextStopper, tokens: list[int], start: int) -> str:
    """Text of ``tokens`` (the generated ones from index ``start``) through the stop-string
    filter, where a stop string ending within the first min_tokens tokens does not count:
    the engine does not stop on one there, so the text is not cut there either."""
    k = max(0, min(len(tokens), p.params.min_tokens - start)) if p.params.stop else 0
    if not k:
        return stopper.feed(dec.feed(tokens))
    head = dec.feed(tokens[:k])
    stopper.count_from(len(head))
    return stopper.feed(head + dec.feed(tokens[k:]) if k < len(tokens) else head)


def prompt_part(prompt: list[int], ch: RequestChannel, cl: CompletionLogprobs | None) -> dict[str, Any] | None:
    """The echoed prompt's logprobs (the first token has none, as in vLLM)."""
    if cl is None:
        return None
    got = ch.prompt_lp or []
    entries = [None, *got[:len(prompt) - 1]]
    entries += [None] * (len(prompt) - len(entries))
    return cl.part(prompt, entries, first_is_none=True)


def final(p: ParsedRequest, ch: RequestChannel, index: int, prompt: list[int], prompt_text: str) -> dict[str, Any]:
    """The whole choice of a finished request (non-streaming responses)."""
    tokens = shown(p, ch)
    dec, stopper = p.decoder(), TextStopper(p.params.stop)
    text = feed(p, dec, stopper, text_tokens(p, ch, tokens), 0) + stopper.feed(dec.flush()) + stopper.finish()
    finish = "stop" if stopper.stopped else ch.finish
    if p.kind == "chat":
        lp = chat_logprobs(tokens, ch.logprobs, p.logprobs, names_for(p.tok)) if p.logprobs is not None else None
        thought: str | None = None
        answer: str | None = text
        calls: list[tuple[str, str]] = []
        if p.reasoning is not None:
            thought, answer, calls = reasoning.split_calls(p.reasoning, text)
            ch.reasoning_tokens = thinking_tokens(p, ch, thought)
        msg: dict[str, Any] = {"role": "assistant", "content": answer}
        if p.tool_call is not None:
            msg, finish = tools.message(p.tool_call, answer or "", finish, calls)
        if p.reasoning is not None:
            if answer is None and msg.get("content") == "":
                msg["content"] = None          # no answer: null, with tools as without
            if p.include_reasoning:
                msg.update(reasoning_fields(thought))
        out_c: dict[str, Any] = {"index": index, "message": msg, "logprobs": lp, "finish_reason": finish}
        if p.return_token_ids:      # (the prompt's: on the response, as vLLM puts chat's)
            out_c["token_ids"] = list(tokens)
        if p.prompt_logprobs is not None:
            out_c["prompt_logprobs"] = prompt_logprobs(prompt, ch.prompt_lp or [], p.prompt_logprobs,
                                                       names_for(p.tok))
        return out_c
    lp = None
    if p.logprobs is not None:
        cl = CompletionLogprobs(p.logprobs, names=names_for(p.tok))
        parts = [prompt_part(prompt, ch, cl)] if p.echo else []
        parts.append(cl.part(tokens, ch.logprobs))
        lp = join(parts)
    if p.echo:
        text = prompt_text + text
    out = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    if p.return_token_ids:
        out["prompt_token_ids"], out["token_ids"] = list(prompt), list(tokens)
    if p.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(prompt, ch.prompt_lp or [], p.prompt_logprobs, names_for(p.tok))
    return out


def thinking_tokens(p: ParsedRequest, ch: RequestChannel, thought: str | None) -> int:
    """How many of the output's tokens were thinking (usage's reasoning_tokens): its text
    encoded again, which gives back the tokens the model wrote but for a rare merge at the
    edges; never more than the output has."""
    if not thought:
        return 0
    if p.tok is not None:
        n = len(p.tok.encode(thought, add_special_tokens=False))
    else:                                   # the byte model: a token a byte
        n = len(thought.encode("utf-8", "replace"))
    return min(n, len(ch.tokens))


def with_reasoning(p: ParsedRequest, u: dict[str, Any], thinking: int) -> dict[str, Any]:
    """``usage`` with ``completion_tokens_details.reasoning_tokens`` (OpenAI's field) where
    a reasoning parser tells the thinking from the answer."""
    if p.kind == "chat" and p.reasoning is not None and not p.drop_output:
        u["completion_tokens_details"] = {"reasoning_tokens": thinking}
    return u


def reasoning_fields(thought: str | None) -> dict[str, Any]:
    """A message's (or delta's) thinking: ``reasoning`` as vLLM names it now, and
    ``reasoning_content``, DeepSeek's name, which many clients still read."""
    return {"reasoning": thought, "reasoning_content": thought}


class StreamChoice:
    """One choice of a streamed response: what its channel has that was not sent yet, as
    ``choices`` entries (the caller wraps them in chunks)."""

    def __init__(self, p: ParsedRequest, ch: RequestChannel, index: int, prompt: list[int], prompt_text: str) -> None:
        self.p, self.ch, self.index = p, ch, index
        self.prompt, self.prompt_text = prompt, prompt_text
        self.dec, self.stopper = p.decoder(), TextStopper(p.params.stop)
        self.want_lp = p.logprobs is not None
        self.names = names_for(p.tok)
        self.cl = CompletionLogprobs(p.logprobs or 0, names=self.names) if self.want_lp and p.kind != "chat" else None
        self.sent = 0
        self.done = False
        self.started = False     # chat's role delta / completion's echo sent
        # a tool call is parsed and sent whole at the end ("auto": only while the output may be one)
        # (gpt-oss's calls are told apart by its harmony splitter: its answer streams as text)
        self.tool_text: list[str] | None = [] if p.tool_call is not None and p.tool_call.fmt != "harmony" else None
        self.held_lp: list[dict[str, Any]] = []   # chat logprobs of the held text
        self.calls_begun = False                  # "auto", a checkpoint's format: a <tool_call> tag came
        self.thinking = p.reasoning.splitter() if p.reasoning is not None else None
        self.thought: list[str] = []              # the thinking so far (its tokens are counted at the end)
        self.ids_due: list[int] | None = [] if p.return_token_ids else None   # token ids not sent yet
        self.prompt_ids_due = p.return_token_ids and p.kind != "chat"   # a completion choice's, first chunk

    def _entry(self, text: str | None, finish: str | None, lp: Any = None, role: bool = False) -> dict[str, Any]:
        if self.p.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def _think(self, parts: tuple[str, str], lp: Any, out: list[dict[str, Any]]) -> tuple[str, Any]:
        """Send the thinking of ``parts`` (with this poll's logprobs); the answer goes on as
        text, with the logprobs when no thinking took them."""
        thought, answer = parts
        if not thought:
            return answer, lp
        self.thought.append(thought)
        if self.p.include_reasoning:
            out.append({"index": self.index, "delta": reasoning_fields(thought), "logprobs": lp, "finish_reason": None})
            return answer, None
        return answer, lp

    def poll(self) -> list[dict[str, Any]]:
        """Entries for what arrived since the last poll (the finish entry last)."""
        out = self._poll()
        if self.ids_due is not None:
            # vLLM's return_token_ids: each entry the ids that came since the last one (a
            # token whose text is held, a stop string's start, rides on a later entry)
            for e in out:
                e["token_ids"], self.ids_due = self.ids_due, []
                if self.prompt_ids_due:
                    e["prompt_token_ids"], self.prompt_ids_due = list(self.prompt), False
        return out

    def _poll(self) -> list[dict[str, Any]]:
        p, ch, out = self.p, self.ch, []
        if self.done:
            return out
        if not self.started:
            if p.kind == "chat":
                # a tool-call stream's content is null, as its non-streamed message's (OpenAI's)
                out.append(self._entry(None if p.tool_call is not None else "", None, role=True))
                self.started = True
            elif not p.echo:
                self.started = True
            elif not self.want_lp or ch.tokens or ch.finish is not None:   # the prompt's logprobs first
                out.append(self._entry(self.prompt_text, None, lp=prompt_part(self.prompt, ch, self.cl)))
                self.started = True
            else:
                return out
        new = ch.tokens[self.sent:]
        lps = ch.logprobs[self.sent:self.sent + len(new)] if self.want_lp and ch.logprobs is not None else None
        self.sent += len(new)
        if self.ids_due is not None and not p.drop_output:
            self.ids_due += new
        if new and not p.drop_output:
            text = feed(p, self.dec, self.stopper, text_tokens(p, ch, new, self.sent), self.sent - len(new))
            lp = None
            if self.want_lp:
                lp = chat_logprobs(new, lps, p.logprobs, self.names) if p.kind == "chat" else self.cl.part(new, lps)
            if self.thinking is not None:
                text, lp = self._think(self.thinking.feed(text), lp, out)
            if self.tool_text is not None:
                self.tool_text.append(text)
                if lp is not None:
                    self.held_lp += lp["content"]
                if p.tool_call.fmt == "hermes":
                    # text streams until a <tool_call> tag; from it on, held to the end
                    send, keep, self.calls_begun = tools.hermes_split("".join(self.tool_text), self.calls_begun)
                    self.tool_text = [keep]
                    if send:
                        out.append(self._entry(send, None, lp={"content": self.held_lp} if self.want_lp else None))
                        self.held_lp = []
                elif p.tool_call.mode == "auto" and not tools.may_be_calls("".join(self.tool_text)):
                    # the model chose text: what was held goes out now, and the rest as it comes
                    text, self.tool_text = "".join(self.tool_text), None
                    out.append(self._entry(text, None, lp={"content": self.held_lp} if self.want_lp else None))
            elif text or lp is not None:
                out.append(self._entry(text, None, lp=lp))
        if ch.finish is not None and self.sent >= len(ch.tokens) and ch.finish not in ("error", "abort"):
            tail = self.stopper.feed(self.dec.flush()) + self.stopper.finish()
            if self.thinking is not None:
                head, held = self.thinking.feed(tail), self.thinking.finish()
                tail = self._think((head[0] + held[0], head[1] + held[1]), None, out)[0]
                self.ch.reasoning_tokens = thinking_tokens(p, self.ch, "".join(self.thought))
            finish = "stop" if self.stopper.stopped else ch.finish
            if p.tool_call is not None and getattr(self.thinking, "calls", None):
                if tail:
                    out.append(self._entry(tail, None))
                entry, finish = tool_delta(p, "", finish, self.index, calls=self.thinking.calls)
                out.append(entry)
            elif self.tool_text is not None:
                entry, finish = tool_delta(p, "".join(self.tool_text) + tail, finish, self.index,
                                           {"content": self.held_lp} if self.want_lp else None)
                out.append(entry)
            elif tail:
                out.append(self._entry(tail, None))
            out.append(self._entry(None if p.kind == "chat" else "", finish))
            self.done = True
        return out


def tool_delta(p: ParsedRequest, text: str, finish: str, index: int, lp: dict[str, Any] | None = None,
               calls: list[tuple[str, str]] | None = None) -> tuple[dict[str, Any], str]:
    """A streamed tool-call choice's one delta (all its calls, or the text, with its
    logprobs ``lp``, when it does not parse) and its finish_reason (``calls``: harmony's)."""
    msg, finish = tools.message(p.tool_call, text, finish, calls)
    delta: dict[str, Any] = {"content": msg["content"]} if msg["content"] is not None else {}
    if "tool_calls" in msg:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]
    return {"index": index, "delta": delta, "logprobs": None if "tool_calls" in msg else lp,
            "finish_reason": None}, finish
