"""Logprobs on their way from a rank's step to its output stream. Pure: no I/O.

A sampled token's logprob rides in the same Delta as the token; prompt logprobs (echo)
come from prefill chunks, which may end a step without a Delta (chunked prefill), so they
wait here until the sequence's next Delta. Only requests that ask for logprobs cost
anything: the worker skips all of this while ``ids`` is empty.
"""

from __future__ import annotations

from typing import Any

from shared.messages import Delta, SamplingParams

# seq id -> (k for the sampled token or None, k for prompt tokens or None, the prompt)
Want = dict[str, tuple[int | None, int | None, list[int]]]


def asks(params: SamplingParams) -> bool:
    return params.logprobs is not None or params.prompt_logprobs is not None


class StepLogprobs:
    def __init__(self) -> None:
        self.ids: dict[str, tuple[int | None, int | None, list[int]]] = {}
        self.tok: dict[str, list[Any]] = {}                    # this step's sampled-token entries
        self.prompt: dict[str, tuple[int, list[Any]]] = {}     # prompt entries not shipped yet

    def track(self, seq_id: str, params: SamplingParams, prompt: list[int]) -> None:
        if asks(params):
            self.ids[seq_id] = (params.logprobs, params.prompt_logprobs, prompt)

    def forget(self, seq_id: str) -> None:
        if self.ids:
            self.ids.pop(seq_id, None)
            self.tok.pop(seq_id, None)
            self.prompt.pop(seq_id, None)

    def wants(self, chunks: list[Any]) -> Want | None:
        """What this step's chunks ask for (None: nothing, the common case)."""
        if not self.ids:
            return None
        ids = self.ids
        want = {c.seq_id: ids[c.seq_id] for c in chunks if c.seq_id in ids}
        return want or None

    def add(self, tok: dict[str, list[Any]], prompt: dict[str, tuple[int, list[Any]]]) -> None:
        """One step's results (tokens' entries replace the last step's)."""
        self.tok = tok
        for sid, (pos, entries) in prompt.items():
            have = self.prompt.get(sid)
            if have is None:
                self.prompt[sid] = (pos, list(entries))
                continue
            start, old = have
            # a recompute after preemption starts over at a lower position: the new ones win
            keep = max(0, min(len(old), pos - start))
            if pos > start + len(old):     # a gap cannot be filled: ship from the new start
                self.prompt[sid] = (pos, list(entries))
            else:
                self.prompt[sid] = (start, old[:keep] + list(entries))

    def fill(self, d: Delta) -> None:
        """Put what ``d``'s sequence has waiting onto it."""
        if d.id not in self.ids:
            return
        e = self.tok.pop(d.id, None)
        if d.tokens:
            # the entry belongs to the last token; earlier ones (never more than a resume's) have none
            d.logprobs = [None] * (len(d.tokens) - 1) + [e]
        p = self.prompt.pop(d.id, None)
        if p is not None:
            d.prompt_lp_pos, d.prompt_lp = p
