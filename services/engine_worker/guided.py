"""Structured output on one rank: a grammar matcher per guided sequence, and the mask of
allowed tokens for each step that samples it. Pure apart from llguidance (no I/O).

The matcher follows ``seq.generated``: before each mask it consumes the tokens generated
since the last one, so a preempted sequence, or one resumed here from another rank with
tokens already generated, is always in step with what the client has. A finished grammar
allows only EOS, so the sampler ends the request there (``finish_reason: "stop"``). Only
guided sequences cost anything: the worker skips this while ``active`` is False. The
matchers compile for the served model's vocabulary (``vocab``: a checkpoint's, set by the
worker once its backend is made; None = the byte model's).
"""

from __future__ import annotations

from typing import Any, Callable

from shared import grammar
from shared.messages import SamplingParams


class _State:
    __slots__ = ("m", "consumed")

    def __init__(self, m: Any) -> None:
        self.m = m
        self.consumed = 0


class Guides:
    def __init__(self, vocab: grammar.Vocab | None = None) -> None:
        self._states: dict[str, _State] = {}
        self.vocab = vocab

    def _vocab(self) -> grammar.Vocab:
        return self.vocab or grammar.byte_vocab()

    @property
    def active(self) -> bool:
        return bool(self._states)

    def track(self, seq_id: str, params: SamplingParams) -> None:
        if params.guide is not None:
            kind, text = params.guide
            try:
                m = grammar.matcher(kind, text, self._vocab())
            except Exception:  # noqa: BLE001 - the api-server checked it; a bad one still must not stop the rank
                m = None       # only EOS is allowed: the request ends at once
            self._states[seq_id] = _State(m)

    def forget(self, seq_id: str) -> None:
        if self._states:
            self._states.pop(seq_id, None)

    def masks(self, chunks: list[Any], get: Callable[[str], Any]) -> dict[str, bytes] | None:
        """{seq id: allowed-token bitmask (bit i of byte i // 8)} for this step's sampled
        chunks of guided sequences; None when there is none."""
        if not self._states:
            return None
        out: dict[str, bytes] = {}
        for c in chunks:
            st = self._states.get(c.seq_id)
            if st is None or not c.sample:
                continue
            seq = get(c.seq_id)
            gen = seq.generated if seq is not None else []
            m = st.m
            if m is None:
                out[c.seq_id] = self._vocab().only_eos()
                continue
            if st.consumed < len(gen):
                for t in gen[st.consumed:]:
                    if not m.consume_token(t):
                        break
                st.consumed = len(gen)
            mask = m.compute_bitmask()
            out[c.seq_id] = self._vocab().only_eos() if m.is_error() else mask
        return out or None
