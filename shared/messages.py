"""Messages that cross Redis, and their codec.

Every stream entry carries one field ``d`` holding an orjson document; the document's
``k`` names its kind. Dataclasses keep the shapes explicit; the codec turns them into
compact dicts (short keys, since they are written on every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

FIELD = b"d"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def loads(raw: bytes | str) -> Any:
    return orjson.loads(raw)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = -1                    # -1 or 0: no cut
    min_p: float = 0.0
    presence_penalty: float = 0.0      # over the generated tokens (OpenAI's)
    frequency_penalty: float = 0.0     # over the generated tokens (OpenAI's)
    repetition_penalty: float = 1.0    # over prompt + generated tokens (vLLM's / HF's)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    min_tokens: int = 0                # no EOS / stop token / stop string before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)     # finish ("stop") on any of these
    logprobs: int | None = None        # None: none; k: the sampled token's logprob + the top k
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (echo)
    guide: list[str] | None = None     # structured output: [kind, text] (shared/grammar.py)

    @property
    def penalized(self) -> bool:
        """True when sampling needs the sequence's token history."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mt": self.max_tokens, "te": self.temperature, "tp": self.top_p,
                             "sd": self.seed, "st": self.stop, "ie": self.ignore_eos}
        # Newer keys only when not at their default: the wire stays what older readers know.
        if self.top_k > 0:
            d["tk"] = self.top_k
        if self.min_p:
            d["mp"] = self.min_p
        if self.presence_penalty:
            d["pp"] = self.presence_penalty
        if self.frequency_penalty:
            d["fp"] = self.frequency_penalty
        if self.repetition_penalty != 1.0:
            d["rp"] = self.repetition_penalty
        if self.logit_bias:
            d["lb"] = [[t, b] for t, b in self.logit_bias.items()]   # JSON keys are strings: pairs
        if self.min_tokens:
            d["mn"] = self.min_tokens
        if self.stop_token_ids:
            d["si"] = self.stop_token_ids
        if self.logprobs is not None:
            d["lp"] = self.logprobs
        if self.prompt_logprobs is not None:
            d["pl"] = self.prompt_logprobs
        if self.guide is not None:
            d["gd"] = self.guide
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(max_tokens=d["mt"], temperature=d["te"], top_p=d["tp"], seed=d["sd"],
                   stop=list(d["st"]), ignore_eos=d["ie"], top_k=d.get("tk", -1), min_p=d.get("mp", 0.0),
                   presence_penalty=d.get("pp", 0.0), frequency_penalty=d.get("fp", 0.0),
                   repetition_penalty=d.get("rp", 1.0), logit_bias={int(t): b for t, b in d.get("lb", ())},
                   min_tokens=d.get("mn", 0), stop_token_ids=list(d.get("si", ())), logprobs=d.get("lp"),
                   prompt_logprobs=d.get("pl"), guide=d.get("gd"))


@dataclass(slots=True)
class Request:
    """A generation request on its way from an api-server to a rank.

    ``generated`` holds tokens already streamed to the client: a request resumed on
    another rank re-prefills prompt + generated and continues at ``len(generated)``.
    """

    id: str
    api: str                       # owning api-server: deltas go to its output stream
    prompt: list[int]              # token ids (byte-level tokenizer)
    params: SamplingParams
    arrival: float                 # unix seconds when the api-server accepted it
    rank: int | None = None        # explicit rank (data_parallel_rank) or assigned rank
    batch: str | None = None       # staggered batch id
    batch_counts: list[int] | None = None  # per-rank counts of that batch
    generated: list[int] = field(default_factory=list)
    dispatcher: str | None = None  # who placed it (Assignment.dispatcher) ...
    dispatch_seq: int = 0          # ... and its per-(dispatcher, rank) seq, echoed in RankStats.recv
    epoch: int = 0                 # bumped on each resume; deltas of an older epoch are ignored
    # The prompt as it came off the wire (hex), reused when the request is written on
    # (scheduler -> inbox) instead of re-encoding it token by token. Prompts never change.
    prompt_wire: str | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def to_dict(self) -> dict[str, Any]:
        if self.prompt_wire is None:
            self.prompt_wire = bytes(self.prompt).hex() if _all_bytes(self.prompt) else ""
        d: dict[str, Any] = {"k": "req", "id": self.id, "api": self.api,
                             "p": self.prompt_wire or self.prompt,
                             "sp": self.params.to_dict(), "at": self.arrival}
        if self.rank is not None:
            d["r"] = self.rank
        if self.batch is not None:
            d["b"] = self.batch
            d["bc"] = self.batch_counts
        if self.generated:
            d["g"] = self.generated
        if self.dispatcher is not None:
            d["dp"] = self.dispatcher
            d["ds"] = self.dispatch_seq
        if self.epoch:
            d["ep"] = self.epoch
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Request":
        p = d["p"]
        prompt = list(bytes.fromhex(p)) if isinstance(p, str) else list(p)
        wire = p if isinstance(p, str) else None
        return cls(id=d["id"], api=d["api"], prompt=prompt,
                   params=SamplingParams.from_dict(d["sp"]), arrival=d["at"],
                   rank=d.get("r"), batch=d.get("b"), batch_counts=d.get("bc"),
                   generated=list(d.get("g", ())), dispatcher=d.get("dp"), dispatch_seq=d.get("ds", 0),
                   epoch=d.get("ep", 0), prompt_wire=wire)


def _all_bytes(tokens: list[int]) -> bool:
    return all(0 <= t < 256 for t in tokens)


@dataclass(slots=True)
class Abort:
    """Stop a request (client went away). Routed by the scheduler to the owning rank."""

    id: str
    rank: int | None = None
    reason: str = "client_disconnected"

    def to_dict(self) -> dict[str, Any]:
        return {"k": "abort", "id": self.id, "r": self.rank, "why": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Abort":
        return cls(id=d["id"], rank=d.get("r"), reason=d.get("why", ""))


@dataclass(slots=True)
class Delta:
    """New tokens of one request. ``pos`` is the index of the first token in ``tokens``
    among the request's generated tokens, so a reader drops anything it already has:
    a redelivery or a resumed request never duplicates text."""

    id: str
    pos: int
    tokens: list[int]
    finish: str | None = None      # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    rank: int = -1
    error: str | None = None
    epoch: int = 0                 # the request's resume epoch on the rank that produced it
    # Logprobs, only when asked for (SamplingParams.logprobs / prompt_logprobs). One entry
    # per token of ``tokens``: [logprob, [[id, logprob], ...top k]]. ``prompt_lp`` holds the
    # entries of prompt positions ``prompt_lp_pos`` on (position 0 has none).
    logprobs: list[Any] | None = None
    prompt_lp: list[Any] | None = None
    prompt_lp_pos: int = 1

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "o": self.pos, "t": self.tokens, "r": self.rank}
        if self.epoch:
            d["ep"] = self.epoch
        if self.logprobs is not None:
            d["lp"] = self.logprobs
        if self.prompt_lp is not None:
            d["pl"] = self.prompt_lp
            d["plo"] = self.prompt_lp_pos
        if self.finish is not None:
            d["f"] = self.finish
            d["pt"] = self.prompt_tokens
        if self.error is not None:
            d["e"] = self.error
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Delta":
        return cls(id=d["id"], pos=d["o"], tokens=d["t"], finish=d.get("f"),
                   prompt_tokens=d.get("pt", 0), rank=d.get("r", -1), error=d.get("e"), epoch=d.get("ep", 0),
                   logprobs=d.get("lp"), prompt_lp=d.get("pl"), prompt_lp_pos=d.get("plo", 1))


def encode_deltas(deltas: list[Delta]) -> bytes:
    """One output-stream entry holds all deltas of one step for one api-server."""
    return orjson.dumps({"k": "out", "ds": [x.to_dict() for x in deltas]})


def decode_entry(raw: bytes) -> dict[str, Any]:
    return orjson.loads(raw)
