"""How many requests a rank can finish a step, and a second: its sequence slots over the
steps a sequence holds one. Pure: what finished passed in.

Short prompts are bounded by slots, not by prompt tokens. A burst of 10,000 chat requests
(1-400 words, 16-63 tokens out) on 4 sim ranks of 128 slots each: 2,848 were admitted
behind a 10 s bound, about 10 s of prompt tokens at the group's full-step rate, but each
waited for a slot that frees only as a request ahead finishes its decode, and the first
token came after p50 / p90 17 / 28 s (2026-12-07). The queue drains at most at
``slots / steps_per_request`` requests a step: this figure, in requests/s once the step
clock knows a full step's time (engine_worker/outputs.py ``seq_rps``), bounds the queue's
wait from below as the prompt tokens over the full-step rate do (scheduler/queue_eta.py).

Each part leans toward more requests a second, so the wait read from them is a lower
bound (a refusal it causes is one a measured rate would cause too): the slots are
``max_num_seqs`` or as many of the recent sequences as the KV cache holds, a sequence
holds its slot one step per token it generated and one per prefill chunk, and a step
computes what a slot-bound backlog gives it, every slot's decode and the prompts of the
requests that replace those finishing, not a full step: decode-heavy steps are far
shorter (long outputs: ~20 ms where a full step takes 131 ms on the default sim
profile), and at the full step's pace the figure would have refused requests that
waited a sixth of what it said.
"""

from __future__ import annotations

MEAN_WEIGHT = 0.02   # each finished sequence's share of the moving means (about the last 50)


class SlotTurnover:
    __slots__ = ("max_num_seqs", "max_tokens", "kv_tokens", "_steps", "_tokens", "_prompt")

    def __init__(self, max_num_seqs: int, max_tokens: int, kv_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_tokens      # a step's token budget: a prompt's chunks
        self.kv_tokens = kv_tokens        # the tokens the rank's KV cache holds
        self._steps = 0.0                 # steps a recent sequence held its slot (moving mean; 0: none yet)
        self._tokens = 0.0                # and its tokens in the KV cache at the end
        self._prompt = 0.0                # and its prompt

    def finished(self, prompt_tokens: int, generated: int) -> None:
        """A sequence of ``prompt_tokens`` ended after generating ``generated`` tokens."""
        steps = max(1, generated) + max(0, -(-prompt_tokens // self.max_tokens) - 1)
        tokens = prompt_tokens + generated
        if self._steps <= 0:
            self._steps, self._tokens, self._prompt = float(steps), float(tokens), float(prompt_tokens)
            return
        self._steps += MEAN_WEIGHT * (steps - self._steps)
        self._tokens += MEAN_WEIGHT * (tokens - self._tokens)
        self._prompt += MEAN_WEIGHT * (prompt_tokens - self._prompt)

    @property
    def slots(self) -> float:
        """How many sequences run at once at most: the slots, or what the KV cache holds."""
        if self._tokens <= 0:
            return float(self.max_num_seqs)
        return max(1.0, min(float(self.max_num_seqs), self.kv_tokens / self._tokens))

    @property
    def per_step(self) -> float:
        """The most requests finished per step (0.0 until one has finished here)."""
        return self.slots / self._steps if self._steps > 0 else 0.0

    @property
    def step_tokens(self) -> float:
        """The tokens a step computes while a backlog keeps every slot busy: each slot's
        decode, and the prompts of the requests that take the slots freed (at most a full
        step)."""
        return min(float(self.max_tokens), self.slots + self.per_step * self._prompt)

    def per_s(self, full_step_ms: float, fixed_ms: float = 0.0) -> float:
        """The same per second: a step of :attr:`step_tokens` costs ``fixed_ms`` plus its
        share of the rest of a full step's ``full_step_ms`` (0.0 when either is unknown)."""
        per_step = self.per_step
        if per_step <= 0 or full_step_ms <= 0:
            return 0.0
        fixed = min(max(0.0, fixed_ms), full_step_ms)
        step_ms = fixed + (full_step_ms - fixed) * self.step_tokens / self.max_tokens
        return per_step * 1000.0 / step_ms
