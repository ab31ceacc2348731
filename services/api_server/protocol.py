"""OpenAI request bodies into one internal shape (pure, no I/O). The Structs of bodies.py
decode and check each field; here the rules that span fields or depend on the served
model, and the mapping into SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import msgspec

from services.api_server import hf_text, tools
from services.api_server.bodies import (CHAT_NEUTRAL, MAX_CHOICES, MAX_STOP_LEN, NEUTRAL, ChatBody, ChatMessage, CompletionBody,
                                        DetokenizeBody, GenerationBody, TokenizeBody)
from services.api_server.decode import decode
from services.api_server.errors import ApiError
from services.api_server.structured import guide
from shared import reasoning
from shared.hf_tokenizer import continue_final, template_variables
from shared.messages import SamplingParams
from shared.reasoning import ANSWER_ONLY
from shared.tokenizer import BOS, EOS, VOCAB_SIZE, StreamDecoder, encode


@dataclass(slots=True)
class ParsedRequest:
    kind: str                      # "completion" | "chat"
    model: str
    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    rank: int | None
    echo: bool = False
    prompt_text: str = ""
    logprobs: int | None = None    # completions: top k (the sampled token's always); chat: top_logprobs
    drop_output: bool = False      # echo with max_tokens 0: one token is generated and not shown
    prompts: list[tuple[list[int], str]] | None = None   # batched completions: every prompt (and text)
    n: int = 1
    best_of: int = 1
    best_of_lp: bool = False       # logprobs asked only to rank best_of candidates: not shown
    tool_call: Any = None          # tools.ToolCall: the output is tool calls (chat)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    prompt_logprobs: int | None = None   # vLLM's prompt_logprobs: top k per prompt token
    ignored: tuple[str, ...] = ()  # unknown top-level fields, ignored (docs/api.md)
    tok: Any = None                # a served checkpoint's tokenizer (None: bytes)
    reasoning: Any = None          # reasoning.for_prompt's: the output's thinking is told from its answer (chat)
    include_reasoning: bool = True  # the thinking is shown (as "reasoning"), not only cut from the content
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response

    @property
    def multi(self) -> bool:
        """More than one engine request answers this one, or streamed tool calls, thinking
        or token ids (multi.py: its StreamChoice tells them from text)."""
        return self.n > 1 or self.best_of > 1 or self.prompts is not None or (
            self.stream and (self.tool_call is not None or self.reasoning is not None or self.return_token_ids))

    def decoder(self) -> Any:
        """A streaming detokenizer of this request's model."""
        if self.tok is None:
            return StreamDecoder()
        return self.tok.stream_decoder(keep_special=self.reasoning is not None and self.reasoning.keep_special)


def chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The model's chat format: role tags on their own lines, then the assistant's turn."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_turn(b: Any) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat or tokenize body, as vLLM
    reads them, except that continue_final_message alone turns the generation prompt off
    (vLLM refuses it beside the default true: the client must send both)."""
    cont = bool(b.continue_final_message)
    if cont and b.add_generation_prompt:
        raise ApiError(400, "'continue_final_message' continues the last message and 'add_generation_prompt' opens "
                       "a new assistant turn: set add_generation_prompt to false (or leave it out)",
                       param="continue_final_message")
    return (not cont if b.add_generation_prompt is None else bool(b.add_generation_prompt)), cont


def byte_chat_prompt(b: Any) -> str:
    """The byte model's prompt text of a chat or tokenize body: its tools, then its turns
    (its template reads no variables: chat_template_kwargs are dropped, _template_kwargs)."""
    gen, cont = chat_turn(b)
    msgs = _messages(b.messages, calls_as_text=True)
    text = chat_template(msgs, gen)
    if cont:
        try:
            text = continue_final(text, msgs)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="continue_final_message") from None
    return tools.tools_block(tools.tool_defs(b.tools)) + text


# Where the byte model's chat turn ends: it never saw EOS, and was trained on turns that
# the next turn's role tag follows (scripts/train-bundled-model), so a new line opening a
# tag is its end of turn (it writes "<|user|>", "<|assistant|>" or a garbled tag there).
END_OF_TURN = "\n<|"

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}" \
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


def _show(v: Any) -> str:
    return msgspec.json.encode(v).decode()


_WHY = {"functions": "use 'tools' and 'tool_choice'", "function_call": "use 'tools' and 'tool_choice'"}
_NEUTRAL_OF = {CompletionBody: {k: v for k, v in NEUTRAL.items() if k in CompletionBody.__struct_fields__},
               ChatBody: {**{k: v for k, v in NEUTRAL.items() if k in ChatBody.__struct_fields__}, **CHAT_NEUTRAL}}


def _is_neutral(v: Any, neutral: tuple[Any, ...]) -> bool:
    if v is None:
        return True
    for n in neutral:
        if type(v) is bool or type(n) is bool:
            if v is n:
                return True
        elif v == n:
            return True
    return False


def _unsupported(b: GenerationBody) -> None:
    """A known parameter at a non-neutral value is refused, naming the field."""
    for name, (neutral, _) in _NEUTRAL_OF[type(b)].items():
        v = getattr(b, name)
        if v is not None and not _is_neutral(v, neutral):
            why = _WHY.get(name)
            raise ApiError(400, f"'{name}' is not supported yet by this server (only the neutral value "
                           f"{'null' if not neutral else ' or '.join(_show(n) for n in neutral)} is accepted)"
                           + (f"; {why}" if why else ""), param=name, code="unsupported_parameter")


def _stop(v: str | list[str] | None) -> list[str]:
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if any(len(s.encode()) > MAX_STOP_LEN for s in stops):   # the Struct counts characters
        raise ApiError(400, f"each stop string must be 1..{MAX_STOP_LEN} bytes", param="stop")
    return stops


def _logit_bias(v: dict[str, float] | None, vocab: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, b in (v or {}).items():
        try:
            t = int(k)
        except ValueError:
            raise ApiError(400, f"'logit_bias' key {k!r} is not a token id", param="logit_bias") from None
        if not 0 <= t < vocab:
            raise ApiError(400, f"'logit_bias' token {t} is outside 0..{vocab - 1}", param="logit_bias")
        if b:
            out[t] = b
    return out


def _stop_token_ids(v: list[int] | None, vocab: int) -> list[int]:
    if not v:
        return []
    if any(t >= vocab for t in v):
        raise ApiError(400, f"'stop_token_ids' must be within 0..{vocab - 1}", param="stop_token_ids")
    return sorted(set(v))


def _logprobs(b: GenerationBody) -> int | None:
    """How many top alternatives per token (None: no logprobs)."""
    if isinstance(b, ChatBody):
        k = b.top_logprobs
        if k and not b.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (k or 0) if b.logprobs else None
    return b.logprobs


def _prompts(prompt: Any, one: Callable[[Any], tuple[list[int], str]]) -> list[tuple[list[int], str]]:
    """A completion's prompt(s): a string, a token list, or a list of either (batched);
    ``one`` turns one prompt into (tokens, text)."""
    if isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        if len(prompt) > MAX_CHOICES:
            raise ApiError(400, f"at most {MAX_CHOICES} prompts in one request", param="prompt")
        out = []
        for i, x in enumerate(prompt):
            try:
                out.append(one(x))
            except ApiError as exc:
                raise ApiError(400, f"prompt[{i}]: {exc.message}", param="prompt") from None
        return out
    return [one(prompt)]


def _prompt_tokens(prompt: Any) -> tuple[list[int], str]:
    if isinstance(prompt, str):
        return encode(prompt), prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if any(t < 0 or t > 255 for t in prompt):
            raise ApiError(400, "token ids must be bytes (0..255) for this byte-level model", param="prompt")
        return list(prompt), bytes(prompt).decode("utf-8", errors="replace")
    if prompt == [] or prompt == [[]]:
        raise ApiError(400, "the prompt is empty", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _part_text(part: Any, role: str, i: int, j: int) -> str:
    """A content part's text: a text part's (``input_text`` / ``output_text`` too, the
    Responses API's names, which vLLM reads as text: clients that turn a Responses history
    into chat send them), or an assistant's refusal (OpenAI accepts the refusal parts its own
    answers carry, sent back in the history)."""
    if part.type in ("text", "input_text", "output_text") and part.text is not None:
        return part.text
    if part.type == "refusal" and role == "assistant" and part.refusal is not None:
        return part.refusal
    where = f"messages[{i}].content[{j}]"
    if part.type in ("text", "input_text", "output_text"):
        raise ApiError(400, f"{where}: a {part.type} part needs its 'text'", param=where)
    if part.type == "refusal":
        if role != "assistant":
            raise ApiError(400, f"{where}: a refusal part is an assistant's (this message's role is {role})",
                           param=where)
        raise ApiError(400, f"{where}: a refusal part needs its 'refusal'", param=where)
    raise ApiError(400, f"{where}: only text parts (and an assistant's refusal parts) are supported, not "
                   f"{part.type!r}", param=where, code="unsupported_parameter")


def _template_kwargs(b: Any, tok: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """(chat_template_kwargs and reasoning_effort as the template reads them, the names
    dropped). gpt-oss's template sets "Reasoning: low|medium|high" from reasoning_effort. A
    variable the template does not read is dropped and logged, as vLLM drops it: clients
    and proxies send enable_thinking or an effort to every model (it was a 400)."""
    kwargs = dict(b.chat_template_kwargs or {})
    template = getattr(tok, "chat_template", None) or ""
    reads = template_variables(template) if template else set()
    own = {"messages", "add_generation_prompt", "tools", "documents", *getattr(tok, "special_tokens", {})}
    dropped = [f"chat_template_kwargs.{k}" for k in kwargs if k not in reads and k not in own]
    kwargs = {k: v for k, v in kwargs.items() if k in reads or k in own}   # own ones: a 400 (hf_text)
    if kwargs and tok is None:      # the byte model's template: the same 400 as a checkpoint's
        raise ApiError(400, f"'chat_template_kwargs': {next(iter(kwargs))!r} is set by the request itself, not by "
                       "chat_template_kwargs", param="chat_template_kwargs")
    effort = getattr(b, "reasoning_effort", None)
    if effort is not None:
        if "reasoning_effort" not in reads:
            dropped.append("reasoning_effort")
        elif kwargs.get("reasoning_effort", effort) != effort:
            raise ApiError(400, "'reasoning_effort' and chat_template_kwargs.reasoning_effort differ: send one",
                           param="reasoning_effort")
        else:
            kwargs["reasoning_effort"] = effort
    return kwargs or None, dropped


def _messages(msgs: list[ChatMessage], calls_as_text: bool = False,
              template_reads_calls: bool = False) -> list[dict[str, Any]]:
    """The chat turns as the templates take them: role and text content (and a tool turn's
    call id, an assistant turn's earlier calls). ``calls_as_text``: a template that reads
    no ``tool_calls`` (the byte model's) gets an assistant turn's calls in its text, after
    whatever text the turn has (they were lost where that text was "" or words).
    ``template_reads_calls``: a checkpoint's template that shows ``tool_calls`` itself gets
    a call turn's null content as "" (not the calls twice) and each call's arguments as an
    object where they parse (as vLLM passes them: templates ``tojson`` them)."""
    out = []
    for i, m in enumerate(msgs):
        content = m.content
        calls = m.tool_calls if m.role == "assistant" else None
        if calls and template_reads_calls:
            calls = [tools.arguments_parsed(c) for c in calls]
            content = "" if content is None else content
        if content is None and m.role == "assistant" and not calls_as_text:
            # an assistant turn that called tools: the calls are its text in the prompt
            content = tools.render_calls(calls) if calls else ""
        if isinstance(content, list):
            # (joined as vLLM joins them)
            content = "\n".join(_part_text(part, m.role, i, j) for j, part in enumerate(content))
        if calls_as_text and m.role == "assistant" and (calls or content is None):
            rendered = tools.render_calls(calls) if calls else ""
            content = "\n".join(x for x in (content, rendered) if x)
        if content is None:
            raise ApiError(400, f"'messages[{i}].content' must be a string or a list of content parts, got null",
                           param=f"messages[{i}].content")
        d: dict[str, Any] = {"role": m.role, "content": content}
        thought = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thought is not None and m.role == "assistant":
            d["reasoning_content"] = d["thinking"] = thought     # (gpt-oss's template reads "thinking")
        if calls:
            d["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _check_model(model: str | None, served_model: str) -> None:
    """A 404 for a model this server does not serve; none (or "") is the served one, as
    vLLM reads it."""
    if model and model != served_model:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found",
                       error_type="invalid_request_error")   # OpenAI's type for it


def _rank(b: GenerationBody, header: str | None, num_ranks: int) -> int | None:
    rank = b.data_parallel_rank
    if rank is None and header is not None:
        try:
            rank = int(header)
        except ValueError:
            raise ApiError(400, "'data_parallel_rank' must be an integer", param="data_parallel_rank") from None
    if rank is not None and not 0 <= rank < num_ranks:
        raise ApiError(400, f"data_parallel_rank {rank} does not exist: this cluster has ranks 0..{num_ranks - 1}",
                       param="data_parallel_rank")
    return rank


def parse(body: bytes | Any, kind: str, *, served_model: str, max_model_len: int, num_ranks: int,
          header_rank: str | None = None, tok: Any = None, reasoning_parser: str = "") -> ParsedRequest:
    """``body``: the request's bytes (or its decoded JSON); ``tok``: a served checkpoint's
    tokenizer (shared/hf_tokenizer.py); None = bytes. ``reasoning_parser``: a name of
    reasoning.PARSERS, or "" (a chat answer's thinking stays in its content)."""
    chat = kind == "chat"
    b: Any
    b, ignored = decode(body, ChatBody if chat else CompletionBody)
    _check_model(b.model, served_model)
    _unsupported(b)
    g_vocab = None if tok is None else tok.grammar_vocab   # the tokens structured output compiles for
    tool_call = tools.parse_tools(b, g_vocab)[1] if chat else None
    if tool_call is not None and tok is not None and tool_call.mode == "auto":
        # what a checkpoint's template teaches it to write (gpt-oss: harmony's commentary channel)
        tool_call.fmt = "harmony" if reasoning_parser == reasoning.HARMONY else "hermes"
    batch: list[tuple[list[int], str]] = []
    if chat and b.include_reasoning is False and not reasoning_parser:
        raise ApiError(400, "'include_reasoning' false needs a reasoning parser to tell the thinking from the answer: "
                       "start the server with LOCKSTEP_REASONING_PARSER (lockstep up --reasoning-parser), or leave "
                       "it out", param="include_reasoning", code="unsupported_parameter")
    if chat:
        kwargs, dropped = _template_kwargs(b, tok)
        ignored = (*ignored, *dropped)
    if chat and tok is not None:
        reads_calls = "tool_calls" in (getattr(tok, "chat_template", None) or "")
        text, prompt = hf_text.chat_prompt(tok, _messages(b.messages, template_reads_calls=reads_calls),
                                           *chat_turn(b), kwargs, tools.template_tools(b.tools))
    elif chat:
        text = byte_chat_prompt(b)
        prompt = encode(text)
    else:
        batch = _prompts(b.prompt, _prompt_tokens if tok is None else partial(hf_text.completion_prompt, tok))
        if any(not toks for toks, _ in batch):
            raise ApiError(400, "the prompt is empty", param="prompt")
        prompt, text = max(batch, key=lambda pt: len(pt[0]))   # the room check below takes the longest
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="messages" if chat else "prompt")
    echo = not chat and bool(b.echo)
    if chat and b.max_completion_tokens is not None:
        max_name, max_tokens = "max_completion_tokens", b.max_completion_tokens
    else:
        max_name, max_tokens = "max_tokens", b.max_tokens
    if max_tokens == 0 and not echo:
        raise ApiError(400, "'max_tokens' must be >= 1 (0 only with echo: the prompt alone), got 0", param=max_name)
    drop_output = max_tokens == 0          # echo only: the engine makes one token, not shown
    if drop_output:
        max_tokens = 1
    room = max_model_len - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(prompt) + (max_tokens or 1)
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{asked} tokens ({len(prompt)} in the prompt, {max_tokens or 1} for the completion). "
                       "Please reduce the prompt or the completion length.",
                       # the field to shorten: the prompt when it alone does not fit
                       param=max_name if room >= 1 else "messages" if chat else "prompt",
                       code="context_length_exceeded")
    # what the request leaves out: the checkpoint's generation_config.json, else OpenAI's
    dflt = getattr(tok, "sampling_defaults", None) or {}
    if max_tokens is None:
        max_tokens = min(dflt["max_tokens"], room) if "max_tokens" in dflt else room if chat else min(16, room)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=dflt.get("temperature", 1.0) if b.temperature is None else b.temperature,
        top_p=dflt.get("top_p", 1.0) if b.top_p is None else b.top_p,
        seed=b.seed,
        stop=_stop(b.stop),
        ignore_eos=bool(b.ignore_eos),
        top_k=dflt.get("top_k", -1) if b.top_k is None else b.top_k,
        min_p=dflt.get("min_p", 0.0) if b.min_p is None else b.min_p,
        presence_penalty=b.presence_penalty or 0.0,
        frequency_penalty=b.frequency_penalty or 0.0,
        repetition_penalty=dflt.get("repetition_penalty", 1.0) if b.repetition_penalty is None
        else b.repetition_penalty,
    )
    stream = bool(b.stream)
    lp = _logprobs(b)
    params.logprobs = lp
    if echo and lp is not None:
        params.prompt_logprobs = lp
    plp = b.prompt_logprobs
    if plp is not None:
        if stream:
            raise ApiError(400, "'prompt_logprobs' cannot be streamed", param="prompt_logprobs")
        params.prompt_logprobs = max(plp, params.prompt_logprobs or 0)
    vocab = VOCAB_SIZE if tok is None else tok.vocab_size
    params.logit_bias = _logit_bias(b.logit_bias, vocab)
    params.stop_token_ids = _stop_token_ids(b.stop_token_ids, vocab)
    if tok is not None:
        hf_text.checkpoint_stops(params, tok)
    params.min_tokens = b.min_tokens or 0
    if params.min_tokens > params.max_tokens:
        raise ApiError(400, f"'min_tokens' ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})",
                       param="min_tokens")
    g = guide(b, g_vocab)
    if tool_call is not None and tool_call.guide is not None:   # a forced call ("auto" writes freely)
        if g is not None:
            raise ApiError(400, f"'{g[0]}' cannot be combined with tool_choice {_show(b.tool_choice)}", param=g[0])
        g = ("tool_choice", tool_call.guide)
    if g is not None and tok is not None and g_vocab is None:
        raise ApiError(400, f"'{g[0]}' needs an EOS token to end the output, and this checkpoint names none "
                       "(generation_config.json eos_token_id)", param=g[0], code="unsupported_parameter")
    if g is not None:
        # a finished grammar allows only EOS: both would make it unreachable
        # (the request's own ignore_eos: a checkpoint's EOS ends it as a stop token id, checkpoint_stops)
        for name, on in (("ignore_eos", bool(b.ignore_eos)), ("min_tokens", params.min_tokens > 0)):
            if on:
                raise ApiError(400, f"'{name}' cannot be combined with structured output ('{g[0]}')", param=name)
        params.guide = g[1]
    elif chat and tok is None and not params.ignore_eos:
        params.stop = [*params.stop, END_OF_TURN]   # a checkpoint's own EOS ends its turns (checkpoint_stops)
    n = 1 if b.n is None else b.n
    best_of = n if b.best_of is None else b.best_of
    if best_of < n:
        raise ApiError(400, f"'best_of' ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and stream:
        raise ApiError(400, "'best_of' greater than n cannot be streamed", param="best_of")
    prompts = batch if len(batch) > 1 else None
    if (len(prompts) if prompts else 1) * best_of > MAX_CHOICES:
        raise ApiError(400, f"prompts x best_of (or n) must be at most {MAX_CHOICES}", param="n")
    best_of_lp = best_of > n and params.logprobs is None
    if best_of_lp:
        params.logprobs = 0        # the candidates are ranked by their cumulative logprob
    opts = b.stream_options
    include_usage = bool(opts is not None and opts.include_usage)
    # vLLM's: usage in every chunk (with include_usage)
    continuous_usage = include_usage and bool(opts.continuous_usage_stats)
    if include_usage and not stream:
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return ParsedRequest(kind=kind, model=b.model or served_model, prompt=prompt, params=params, stream=stream,
                         include_usage=include_usage, rank=_rank(b, header_rank, num_ranks), echo=echo,
                         prompt_text=text, ignored=ignored, logprobs=lp, drop_output=drop_output,
                         prompts=prompts, n=n, best_of=best_of, best_of_lp=best_of_lp, tool_call=tool_call,
                         continuous_usage=continuous_usage, prompt_logprobs=plp, tok=tok,
                         reasoning=None if not (chat and reasoning_parser) else ANSWER_ONLY if g is not None
                         else reasoning.for_prompt(reasoning_parser, text),   # a grammar's output is all answer
                         include_reasoning=not chat or b.include_reasoning is not False,
                         return_token_ids=bool(b.return_token_ids))


# --- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------

SPECIAL_TOKENS = {EOS: "<|eos|>", BOS: "<|bos|>"}


def token_str(t: int) -> str:
    """A token's name: the byte itself when it is printable ASCII, else <0xNN>, or a special's name."""
    if t >= 256:
        return SPECIAL_TOKENS.get(t, f"<|reserved_{t}|>")
    return chr(t) if 32 <= t < 127 else f"<0x{t:02X}>"


def parse_tokenize(body: bytes | Any, served_model: str, tok: Any = None) -> tuple[list[int], bool]:
    """(tokens, return_token_strs) for a /tokenize body (add_special_tokens is accepted:
    this tokenizer adds none)."""
    b, _ = decode(body, TokenizeBody)
    _check_model(b.model, served_model)
    strs = bool(b.return_token_strs)
    if (b.prompt is None) == (b.messages is None):
        raise ApiError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
    if b.prompt is not None:
        return (encode(b.prompt) if tok is None else tok.encode(b.prompt)), strs
    if tok is not None:
        return hf_text.chat_prompt(tok, _messages(b.messages), *chat_turn(b), _template_kwargs(b, tok)[0],
                                   tools.template_tools(b.tools))[1], strs
    # tools are shown in the prompt as a chat completion shows them, so the count is the same
    return encode(byte_chat_prompt(b)), strs


def parse_detokenize(body: bytes | Any, served_model: str, tok: Any = None) -> list[int]:
    b, _ = decode(body, DetokenizeBody)
    _check_model(b.model, served_model)
    vocab = VOCAB_SIZE if tok is None else tok.vocab_size
    if any(t >= vocab for t in b.tokens):
        raise ApiError(400, f"token ids must be within 0..{vocab - 1}", param="tokens")
    return b.tokens
