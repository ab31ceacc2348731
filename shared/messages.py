"""Messages that cross Redis: one msgspec Struct each, at once definition, validation
and wire form.

Every stream entry carries one field ``d`` holding a JSON document; a tagged message's
``k`` names its kind. Keys are short (they are written with every step and token), and a
field at its default is left out (``omit_defaults``), so a newer optional field costs
nothing. The few keys the first codec always wrote stay always written, so a rank of an
older release reads what a newer one writes during a rolling restart (docs/redis-keys.md,
*Message shapes*). Readers ignore keys they do not know.

Two fields travel in a denser form than they live in memory: a prompt of byte-sized token
ids as one hex string (half the size of a JSON list and four times quicker to read), and
``logit_bias`` as ``[id, bias]`` pairs (JSON object keys are strings). ``encode`` writes
those forms; decoding accepts both forms of each.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import orjson
from msgspec import Struct, field

FIELD = b"d"

_encoder = msgspec.json.Encoder()
T = TypeVar("T")


class MessageError(ValueError):
    """A malformed message: which kind, and what is wrong where (wire key path)."""


def encode(msg: Struct) -> bytes:
    """A message's wire form (the value of an entry's ``d`` field)."""
    if isinstance(msg, (Request, SamplingParams)):   # the two with a denser wire form
        msg = msg._wire()
    return _encoder.encode(msg)


def dumps(obj: Any) -> bytes:
    """Any document: messages through ``encode``, plain values through orjson."""
    if isinstance(obj, Struct):
        return encode(obj)
    return orjson.dumps(obj)


def loads(raw: bytes | str) -> dict[str, Any]:
    """An entry's document. Not a JSON object: MessageError (``bus.decode_entries`` turns
    both into a ``corrupt`` entry, so a reader's ``doc.get`` never meets a list or a number)."""
    doc = orjson.loads(raw)
    if type(doc) is not dict:
        raise MessageError(f"an entry must hold a JSON object, not {type(doc).__name__}")
    return doc


def convert(doc: Any, cls: type[T], *, strict: bool = True) -> T:
    """A decoded document (``bus.decode_entries`` gives dicts) as message ``cls``;
    raises MessageError naming what is wrong."""
    try:
        return msgspec.convert(doc, cls, strict=strict)
    except msgspec.ValidationError as exc:
        raise MessageError(f"malformed {_name(cls)} message: {exc}") from None


def decode(raw: bytes | str, cls: type[T]) -> T:
    """Raw JSON straight to message ``cls`` (no intermediate dict); raises MessageError."""
    try:
        return msgspec.json.decode(raw, type=cls)
    except msgspec.DecodeError as exc:   # ValidationError included
        raise MessageError(f"malformed {_name(cls)} message: {exc}") from None


def _name(cls: Any) -> str:
    return getattr(cls, "__name__", None) or str(cls).replace(f"{__name__}.", "")


class SamplingParams(Struct, omit_defaults=True):
    # The first six are always written (readers before msgspec require them): msgspec
    # omits a default that is a value or an empty builtin collection, never one made by
    # a factory of our own.
    max_tokens: int = field(default_factory=lambda: 16, name="mt")
    temperature: float = field(default_factory=lambda: 1.0, name="te")
    top_p: float = field(default_factory=lambda: 1.0, name="tp")
    seed: int | None = field(default_factory=lambda: None, name="sd")
    stop: list[str] = field(default_factory=lambda: [], name="st")
    ignore_eos: bool = field(default_factory=lambda: False, name="ie")
    top_k: int = field(default=-1, name="tk")                  # -1 or 0: no cut
    min_p: float = field(default=0.0, name="mp")
    presence_penalty: float = field(default=0.0, name="pp")   # over the generated tokens (OpenAI's)
    frequency_penalty: float = field(default=0.0, name="fp")  # over the generated tokens (OpenAI's)
    repetition_penalty: float = field(default=1.0, name="rp")  # over prompt + generated (vLLM's / HF's)
    # token id -> added to its logit; [[id, bias], ...] on the wire (see the module docstring)
    logit_bias: dict[int, float] | list[tuple[int, float]] = field(default_factory=dict, name="lb")
    min_tokens: int = field(default=0, name="mn")             # no EOS / stop token / stop string before
    stop_token_ids: list[int] = field(default_factory=list, name="si")   # finish ("stop") on any of these
    logprobs: int | None = field(default=None, name="lp")     # None: none; k: the sampled token's + top k
    prompt_logprobs: int | None = field(default=None, name="pl")  # the same for every prompt token but the first
    guide: list[str] | None = field(default=None, name="gd")  # structured output: [kind, text] (shared/grammar.py)

    def __post_init__(self) -> None:
        if type(self.logit_bias) is list:
            self.logit_bias = dict(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """True when sampling needs the sequence's token history."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _wire(self) -> "SamplingParams":
        if not self.logit_bias:
            return self
        w = self.__copy__()      # a shallow copy: no __post_init__, this object untouched
        w.logit_bias = [(t, b) for t, b in self.logit_bias.items()]   # type: ignore[assignment]
        return w

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self._wire())

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        return convert(d, cls)


# dict=True: room for the prompt's hex form (not a field, never encoded as itself).
class Request(Struct, tag="req", tag_field="k", omit_defaults=True, dict=True):
    """A generation request on its way from an api-server to a rank.

    ``generated`` holds tokens already streamed to the client: a request resumed on
    another rank re-prefills prompt + generated and continues at ``len(generated)``.
    """

    id: str
    api: str                       # owning api-server: deltas go to its output stream
    prompt: list[int] | str = field(name="p")   # token ids; hex on the wire (a list after decoding)
    params: SamplingParams = field(name="sp")
    arrival: float = field(name="at")            # unix seconds when the api-server accepted it
    rank: int | None = field(default=None, name="r")     # explicit (data_parallel_rank) or assigned rank
    batch: str | None = field(default=None, name="b")    # staggered batch id
    batch_counts: list[int] | None = field(default=None, name="bc")  # per-rank counts of that batch
    generated: list[int] = field(default_factory=list, name="g")
    dispatcher: str | None = field(default=None, name="dp")  # who placed it (Assignment.dispatcher) ...
    dispatch_seq: int = field(default=0, name="ds")  # ... its per-(dispatcher, rank) seq, echoed in RankStats.recv
    epoch: int = field(default=0, name="ep")     # bumped on each resume; deltas of an older epoch are ignored

    def __post_init__(self) -> None:
        p = self.prompt
        if type(p) is str:
            # Kept: written on unchanged (scheduler -> inbox); prompts never change.
            self.prompt_wire = p
            self.prompt = list(bytes.fromhex(p))   # ValueError: msgspec reports it as invalid

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def _wire(self) -> "Request":
        hexed = self.__dict__.get("prompt_wire")
        if hexed is None:
            try:
                hexed = bytes(self.prompt).hex()
            except (ValueError, TypeError):   # an id above 255 (a real tokenizer's): a JSON list
                hexed = ""
            self.prompt_wire = hexed
        params = self.params._wire()
        if not hexed and params is self.params:
            return self
        w = self.__copy__()
        if hexed:
            w.prompt = hexed
        w.params = params
        return w

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self._wire())

    @classmethod
    def from_dict(cls, d: Any) -> "Request":
        return convert(d, cls)


class Abort(Struct, tag="abort", tag_field="k"):
    """Stop a request (client went away). Routed by the scheduler to the owning rank.
    Every key always written (tiny, rare, and older readers expect ``why``)."""

    id: str
    rank: int | None = field(default=None, name="r")
    reason: str = field(default="client_disconnected", name="why")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Abort":
        return convert(d, cls)


class Retire(Struct, tag="retire", tag_field="k", omit_defaults=True):
    """Drop this rank's copy of request ``id`` if its epoch is ``epoch`` or older: its
    api-server resumed it under a newer epoch (the rank was taken for dead while its
    heartbeat lapsed, or Redis lost the streams) and ignores that copy's deltas. Written
    straight to the rank's inbox by the api-server, or by the scheduler when it places the
    newer copy on another rank; no delta answers it. A newer copy stays. ``since``: when it was
    first written (ms), set once the scheduler's recovery puts it back at the tail of an
    inbox whose rank is still taken for dead (services/scheduler/orphan_page.py)."""

    id: str
    rank: int = field(name="r")
    epoch: int = field(name="ep")
    since: int = field(default=0, name="t")

    @classmethod
    def from_dict(cls, d: Any) -> "Retire":
        return convert(d, cls)


class Delta(Struct, omit_defaults=True):
    """New tokens of one request. ``pos`` is the index of the first token in ``tokens``
    among the request's generated tokens, so a reader drops anything it already has:
    a redelivery or a resumed request never duplicates text."""

    id: str
    pos: int = field(name="o")
    tokens: list[int] = field(name="t")
    finish: str | None = field(default=None, name="f")   # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = field(default=0, name="pt")     # read with ``finish``: set it on the final delta only
    rank: int = field(default=-1, name="r")
    error: str | None = field(default=None, name="e")
    epoch: int = field(default=0, name="ep")             # the request's resume epoch on the rank that produced it
    # Logprobs, only when asked for (SamplingParams.logprobs / prompt_logprobs). One entry
    # per token of ``tokens``: [logprob, [[id, logprob], ...top k]]. ``prompt_lp`` holds the
    # entries of prompt positions ``prompt_lp_pos`` on (position 0 has none).
    logprobs: list[Any] | None = field(default=None, name="lp")
    prompt_lp: list[Any] | None = field(default=None, name="pl")
    prompt_lp_pos: int = field(default=1, name="plo")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Delta":
        return convert(d, cls)


class Outputs(Struct, tag="out", tag_field="k"):
    """One output-stream entry: all deltas of one step for one api-server."""

    ds: list[Delta]


class Resume(Struct, tag="resume", tag_field="k"):
    """Output-stream notice: these requests' rank is gone; the api-server resubmits each
    with the tokens its client already has."""

    ids: list[str]


class WaveNotice(Struct, omit_defaults=True):
    """``{ls}:wave`` entry: wake for wave ``w`` (``r`` = -1: from a dispatcher, written by
    the wake script of shared/wake.py in this same shape), or re-form the engine group at
    generation ``reform`` (from the replacement rank ``r``)."""

    w: int
    r: int
    reform: int | None = None

    @classmethod
    def from_dict(cls, d: Any) -> "WaveNotice":
        return convert(d, cls)


def encode_deltas(deltas: list[Delta]) -> bytes:
    """One output-stream entry holds all deltas of one step for one api-server. Written
    as given: the engine sets ``prompt_tokens`` on final deltas only."""
    return _encoder.encode(Outputs(deltas))


def output_entry(doc: Any) -> "Outputs | Resume":
    """An output-stream document as its message (by ``k``); MessageError otherwise."""
    return convert(doc, Outputs | Resume)


def request_owner(doc: dict[str, Any]) -> tuple[str, str] | None:
    """(api, id) of a request entry's document, for its ``resume`` notice; None for an
    abort, a corrupt entry or a request too malformed to name its owner."""
    api, rid = doc.get("api"), doc.get("id")
    if doc.get("k") == "req" and type(api) is str and type(rid) is str:
        return api, rid
    return None
