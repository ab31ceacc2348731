"""Next-token sampling whose randomness depends only on (request seed, token position).

A row with temperature <= 0 is greedy (argmax, first index on ties). Otherwise the logits
are divided by the temperature, cut to the smallest set of most likely tokens whose
probability reaches top_p (the most likely token is always kept), and one token is drawn
by inverse-CDF with a uniform number derived from (seed, position) by splitmix64. So the
draw never depends on which other requests share the batch, on the rank, or on any global
RNG state; seed None draws from the process RNG (nondeterministic by design).
The math runs in float64, row by row in effect, so a row's result cannot depend on others.

Optional per-row ``RowExtra`` (vLLM's semantics), applied in this order:
logit_bias added, ``suppress``ed tokens (EOS and stop tokens before min_tokens) and tokens
a grammar does not allow (``allowed``, structured output) set to -inf, on every row; then
penalties on the raw logits (greedy rows too): repetition_penalty over prompt + output
tokens (a positive logit is divided by it, a negative one multiplied), then
frequency_penalty x count and presence_penalty x (count > 0) subtracted, counts over the
output tokens; then, for sampled rows, after the temperature: top_k (keep the k most
likely; <= 0 keeps all), min_p (keep tokens with probability >= min_p x the largest), then
top_p over the mass of what those kept.

``logprobs`` gives each sampled token's log-probability and the k most likely tokens of
the same step's logits (the raw model output, before any of the above: vLLM's default).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that is a pure function of (seed, position)."""
    z = _splitmix64(_splitmix64(seed & _M64) ^ (position & _M64))
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass(slots=True)
class RowExtra:
    """A row's sampling beyond temperature/top_p/seed (all neutral by default)."""
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt: list[int] = field(default_factory=list)     # for repetition_penalty
    output: list[int] = field(default_factory=list)     # tokens generated so far
    logit_bias: dict[int, float] = field(default_factory=dict)
    suppress: list[int] = field(default_factory=list)   # never sampled this step (min_tokens)
    allowed: bytes | None = None    # structured output: bit i of byte i // 8 set = token i allowed


    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def edits_logits(self) -> bool:
        return self.penalized or bool(self.logit_bias) or bool(self.suppress) or self.allowed is not None


def _bias(row: torch.Tensor, e: RowExtra) -> torch.Tensor:
    V = row.shape[0]
    if e.logit_bias:
        ids = [t for t in e.logit_bias if 0 <= t < V]
        if ids:
            row[torch.tensor(ids, device=row.device)] += torch.tensor(
                [float(e.logit_bias[t]) for t in ids], dtype=row.dtype, device=row.device)
    ids = [t for t in e.suppress if 0 <= t < V]
    if ids:
        row[torch.tensor(ids, device=row.device)] = float("-inf")
    return row


def allowed_tokens(mask: bytes, V: int) -> torch.Tensor:
    """A grammar's bitmask (bit i of byte i // 8) as V booleans; ids past the mask are not allowed."""
    return allowed_rows([mask], V)[0]


def allowed_rows(masks: list[bytes], V: int) -> torch.Tensor:
    """Several rows' bitmasks (of one length) as a [rows, V] bool tensor, in one unpacking."""
    b = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1)
    bits = ((b[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1).bool()
    out = torch.zeros(len(masks), V, dtype=torch.bool)
    n = min(V, bits.shape[1])
    out[:, :n] = bits[:, :n]
    return out


def _penalize(row: torch.Tensor, e: RowExtra) -> torch.Tensor:
    V = row.shape[0]
    row = row.double()
    if e.repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool, device=row.device)
        ids = [t for t in (*e.prompt, *e.output) if 0 <= t < V]
        if ids:
            seen[torch.tensor(ids, device=row.device)] = True
        rp = e.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
    if e.output and (e.frequency_penalty or e.presence_penalty):
        counts = torch.bincount(torch.tensor([t for t in e.output if 0 <= t < V], dtype=torch.long,
                                             device=row.device), minlength=V)[:V].double()
        row = row - e.frequency_penalty * counts - e.presence_penalty * (counts > 0).double()
    return row


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           seeds: list[int | None], positions: list[int],
           extras: list[RowExtra | None] | None = None) -> list[int]:
    """logits [B, V] -> one token id per row. ``positions[i]`` is the position the sampled
    token will occupy in its sequence (its index counting from 0). ``extras[i]``, when
    given and not None, adds top_k, min_p and the penalties to row i."""
    B, V = logits.shape
    if not (len(temperatures) == len(top_ps) == len(seeds) == len(positions) == B):
        raise ValueError("sample() needs one temperature, top_p, seed and position per row")
    if extras is not None and len(extras) != B:
        raise ValueError("sample() needs one extra (or None) per row")
    if extras is not None and any(e is not None and e.edits_logits for e in extras):
        logits = logits.double().clone()
        guided = [i for i, e in enumerate(extras) if e is not None and e.allowed is not None]
        if guided:   # grammar masks of all guided rows at once (structured output)
            ok = allowed_rows([extras[i].allowed for i in guided], V).to(logits.device)
            logits[guided] = logits[guided].masked_fill(~ok, float("-inf"))
        for i, e in enumerate(extras):
            if e is not None and (e.logit_bias or e.suppress):
                logits[i] = _bias(logits[i], e)
            if e is not None and e.penalized:
                logits[i] = _penalize(logits[i], e)
    out = logits.argmax(dim=-1).tolist() if B else []
    rows = [i for i in range(B) if temperatures[i] > 0]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    temp = torch.tensor([temperatures[i] for i in rows], dtype=torch.float64, device=logits.device)
    top_p = torch.tensor([top_ps[i] for i in rows], dtype=torch.float64, device=logits.device)
    u = torch.tensor([random.random() if seeds[i] is None else seeded_uniform(seeds[i], positions[i])
                      for i in rows], dtype=torch.float64, device=logits.device)

    probs = torch.softmax(logits[idx].double() / temp[:, None], dim=-1)
    p_sorted, tok_sorted = probs.sort(dim=-1, descending=True, stable=True)
    if extras is not None and any(extras[i] is not None and (extras[i].top_k > 0 or extras[i].min_p > 0)
                                  for i in rows):
        # top_k and min_p first; top_p then measures the mass of what they kept (as vLLM).
        rank = torch.arange(V, device=logits.device)
        cut = torch.ones_like(p_sorted, dtype=torch.bool)
        for j, i in enumerate(rows):
            e = extras[i]
            if e is None:
                continue
            if e.top_k > 0:
                cut[j] &= rank < e.top_k
            if e.min_p > 0:
                cut[j] &= p_sorted[j] >= e.min_p * p_sorted[j, 0]
        cut[:, 0] = True
        p_sorted = torch.where(cut, p_sorted, 0.0)
        p_norm = p_sorted / p_sorted.sum(-1, keepdim=True)
        mass_before = p_norm.cumsum(-1) - p_norm
        keep = (mass_before < top_p[:, None]) & cut
    else:
        mass_before = p_sorted.cumsum(-1) - p_sorted
        keep = mass_before < top_p[:, None]
    keep[:, 0] = True                                    # the most likely token always stays
    p_sorted = torch.where(keep, p_sorted, 0.0)
    cdf = p_sorted.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=V - 1)
    chosen = tok_sorted.gather(1, pick).squeeze(1).tolist()
    for i, t in zip(rows, chosen):
        out[i] = t
    return out


def logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[list]:
    """logits [B, V], the token each row sampled and how many top alternatives it wants ->
    per row ``[logprob of the token, [[id, logprob], ...k most likely, best first], rank]``
    (log-softmax in float32 of the raw logits; ties: lower id first; rank: 1 + the tokens
    strictly more likely)."""
    B, V = logits.shape
    if not (len(tokens) == len(ks) == B):
        raise ValueError("logprobs() needs one token and one k per row")
    if not B:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])
    ranks = ((lp > picked).sum(-1) + 1).tolist()
    chosen = picked.squeeze(1).tolist()
    kmax = min(max(ks), V)
    if kmax <= 0:
        return [[c, [], k] for c, k in zip(chosen, ranks)]
    top_lp, top_id = lp.sort(dim=-1, descending=True, stable=True)
    top_lp, top_id = top_lp[:, :kmax].tolist(), top_id[:, :kmax].tolist()
    return [[c, [[i, v] for i, v in zip(top_id[r][:ks[r]], top_lp[r][:ks[r]])], ranks[r]]
            for r, c in enumerate(chosen)]
