"""A checkpoint's own tokenizer (tokenizer.json through the ``tokenizers`` library) and
chat template (jinja2, rendered as transformers renders it), behind the small interface
the api-servers use; the bundled model's byte-level tokenizer (shared/tokenizer.py)
satisfies it too, through :class:`ByteTokenizer`. ``load_tokenizer`` picks one."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol


class StreamingDecoder(Protocol):
    def feed(self, tokens: list[int]) -> str: ...
    def flush(self) -> str: ...


def continue_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """``rendered`` (the chat rendered without a generation prompt) cut right after the final
    message's text, so the model continues that message instead of starting a new turn
    (``continue_final_message``: an assistant reply begun by the client, "Sure," or "{").
    As transformers' apply_chat_template cuts it; ValueError where the template did not
    render the final message's text."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a final message with text to continue")
    if final.strip() not in rendered:
        raise ValueError("continue_final_message: the chat template does not render the final message's text "
                         "as it was sent, so there is nothing to continue from")
    at = rendered.rindex(final.strip())
    if rendered[at:at + len(final.lstrip())] == final:   # the template kept its spacing
        return rendered[:at + len(final.lstrip())]
    return rendered[:at + len(final.strip())]


class TextTokenizer(Protocol):
    """What the api-server needs of a tokenizer (prompts, streaming text, usage, stops)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]   # end a sequence (from generation_config.json for a checkpoint)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def stream_decoder(self, keep_special: bool = False) -> StreamingDecoder: ...
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> str: ...


class ByteTokenizer:
    """The bundled model's byte-level tokenizer behind the same interface."""

    def __init__(self, render: Callable[..., str]) -> None:
        from shared import tokenizer as bt
        self._bt = bt
        self._render = render
        self.vocab_size = bt.VOCAB_SIZE
        self.eos_token_ids = (bt.EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._bt.encode(text)

    def decode(self, tokens: list[int]) -> str:
        return self._bt.decode(tokens)

    def stream_decoder(self, keep_special: bool = False) -> StreamingDecoder:
        return self._bt.StreamDecoder()         # (its EOS and BOS are never text)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        if template_kwargs:
            raise ValueError("the byte model's chat template reads no variables")
        return self._render(messages, add_generation_prompt)


def _token_content(v: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class HFTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.model_dir = d
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d / 'tokenizer.json'} not found: the checkpoint directory needs its "
                                    "tokenizer (tokenizer.json, tokenizer_config.json)")
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        self.special_tokens = {k: _token_content(cfg.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.chat_template = _chat_template(d, cfg)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.eos_token_ids = self._eos_ids(d)
        self.sampling_defaults = sampling_defaults(_read_json(d / "generation_config.json"))
        self._byte_inverse: dict[str, int] | None = None   # token_bytes: ByteLevel's map ({}: not byte-level)

    def _eos_ids(self, d: Path) -> tuple[int, ...]:
        gen = _read_json(d / "generation_config.json").get("eos_token_id")
        if gen is None:
            gen = _read_json(d / "config.json").get("eos_token_id")
        if gen is None and self.special_tokens["eos_token"]:
            gen = self._tok.token_to_id(self.special_tokens["eos_token"])
        ids = gen if isinstance(gen, list) else [] if gen is None else [gen]
        return tuple(int(i) for i in ids)

    # -- text <-> tokens --------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, tokens: list[int], keep_special: bool = False) -> str:
        return self._tok.decode(list(tokens), skip_special_tokens=not keep_special)

    def stream_decoder(self, keep_special: bool = False) -> "IncrementalDecoder":
        """``keep_special``: special tokens are text (harmony's frame, for its parser)."""
        return IncrementalDecoder(lambda ids: self.decode(ids, keep_special))

    def token_str(self, t: int) -> str:
        return self._tok.id_to_token(t) or ""

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, t: int) -> bool:
        return t in self._special_ids

    def token_bytes(self, t: int) -> bytes:
        """The bytes token ``t`` stands for (b"" for a special token): a byte-level BPE
        token's own bytes, a byte-fallback piece's byte, a metaspace piece's text with its
        spaces; a piece of a multi-byte character is its bytes, not U+FFFD's."""
        s = self.token_str(t)
        if self.is_special(t) or not s:
            return b""
        if self._byte_inverse is None:
            raw = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = {raw.get("type")} | {x.get("type") for x in raw.get("decoders") or []}
            self._byte_inverse = _byte_level_inverse() if "ByteLevel" in kinds else {}
        if self._byte_inverse:
            return bytes(self._byte_inverse.get(c, 0x3F) for c in s)
        if m := _BYTE_TOKEN.match(s):
            return bytes([int(m.group(1), 16)])
        return s.replace("\u2581", " ").encode("utf-8")

    @property
    def grammar_vocab(self) -> Any:
        """These tokens as structured output's grammars see them (shared/grammar.py Vocab;
        built on first use, about a second for a large vocabulary, then cached). None for a
        checkpoint that names no EOS token: nothing could end a finished grammar's output."""
        if not self.eos_token_ids:
            return None
        from shared import grammar
        return grammar.checkpoint_vocab(str(self.model_dir), self.eos_token_ids)

    # -- chat -------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text exactly as transformers' apply_chat_template(tokenize=False)
        renders it (encode it with add_special_tokens=False, as transformers does).
        ``template_kwargs``: more variables for the template (``enable_thinking``...), as
        transformers passes its extra keyword arguments; ValueError for one the template
        does not read, or one that would replace what it is given. ``tools``: OpenAI's
        function tools, as transformers passes them; ValueError where the template does not
        read them (the model would never see them)."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); use /v1/completions")
        extra = template_kwargs or {}
        self.check_template_kwargs(extra)
        if tools and not self.reads_tools:
            raise ToolsUnread("this checkpoint's chat template does not show tools to the model (it reads no "
                              "'tools'): send them in a message, or serve a checkpoint whose template does")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None, documents=None,
            **{k: v for k, v in self.special_tokens.items() if v is not None}, **extra)

    @property
    def reads_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in template_variables(self.chat_template)

    def check_template_kwargs(self, template_kwargs: dict[str, Any]) -> None:
        """ValueError for a template variable the chat template does not read (it would do
        nothing: refused, not ignored) or one the request sets itself."""
        own = {"messages", "add_generation_prompt", "tools", "documents", *self.special_tokens}
        for k in template_kwargs:
            if k in own:
                raise ValueError(f"{k!r} is set by the request itself, not by chat_template_kwargs")
            if self.chat_template and k not in template_variables(self.chat_template):
                raise ValueError(f"this checkpoint's chat template does not read {k!r}")

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class ToolsUnread(ValueError):
    """Tools for a chat template that does not read them."""


class IncrementalDecoder:
    """Streamed text of a growing token list that never splits a character: it decodes a
    short window of recent tokens (so merges and leading-space rules see their context)
    and emits only the text that the newest tokens added, holding back a tail that ends
    in U+FFFD (an incomplete multi-byte character whose next bytes are still to come).
    The pieces joined equal ``decode(all tokens)``, less a character cut in two at the end."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0     # window start: tokens before it are never decoded again
        self._read = 0       # tokens whose text was emitted

    def feed(self, tokens: list[int]) -> str:
        ids = self._ids
        ids.extend(tokens)
        before = self._decode(ids[self._prefix:self._read])
        now = self._decode(ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return now[len(before):]

    def flush(self) -> str:
        """What is still held back, less a character the length cap cut in two (it would
        decode to U+FFFD; dropped, as vLLM does)."""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):].rstrip("\ufffd")


# generation_config.json's sampling fields a request that leaves them out gets, as vLLM's
# --generation-config auto (its default) gives them: what the checkpoint's authors tuned
# it for (Qwen3: temperature 0.6, top_p 0.95, top_k 20), where 1.0 / no cut makes it ramble.
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(gen: dict[str, Any]) -> dict[str, float | int]:
    """The request defaults a checkpoint's generation_config.json sets (request names: its
    max_new_tokens is max_tokens); a value of the wrong type or out of range is left out."""
    out: dict[str, float | int] = {}
    for src, name in _SAMPLING_FIELDS.items():
        v = gen.get(src)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if name == "top_k":
            if v == int(v) and v >= 0:
                out[name] = int(v) if v > 0 else -1     # transformers' 0 is no cut, vLLM's -1
        elif name == "max_tokens":
            if v == int(v) and v >= 1:
                out[name] = int(v)
        elif name == "temperature" and v >= 0 or name in ("top_p", "min_p") and 0 <= v <= 1 or \
                name == "repetition_penalty" and v > 0:
            out[name] = float(v)
    if out.get("top_p") == 0:
        del out["top_p"]                                 # no token could be drawn
    return out


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(d: Path, cfg: dict[str, Any]) -> str | None:
    if (d / "chat_template.jinja").is_file():      # newer transformers saves it beside the config
        return (d / "chat_template.jinja").read_text()
    t = cfg.get("chat_template")
    if isinstance(t, list):                        # named templates: the default one
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads that it does not set itself."""
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


@lru_cache(maxsize=8)
def _compile(template: str):
    """A sandboxed environment with transformers' settings and globals (trim_blocks,
    lstrip_blocks, loopcontrols, raise_exception, strftime_now, a tojson that keeps
    non-ASCII and does not escape HTML)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
    shifted to code points 256 and up; this maps each character back to its byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + n)] = b
            n += 1
    return out


def token_bytes_table(tok: HFTokenizer) -> list[bytes]:
    """The bytes each token id stands for (b"" for special tokens): the engine's view of
    the text for stop strings, as the byte tokenizer's ids are its bytes."""
    return [tok.token_bytes(i) for i in range(tok.vocab_size)]


def load_tokenizer(model_dir: str | None, byte_chat: Callable[..., str]) -> TextTokenizer:
    """The checkpoint's tokenizer when a model directory is served, else the byte tokenizer
    (whose chat rendering, ``byte_chat``, lives with the api-server)."""
    return HFTokenizer(model_dir) if model_dir else ByteTokenizer(byte_chat)
