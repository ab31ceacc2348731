"""Next-token sampling whose randomness depends only on (request seed, token position).

A row with temperature <= 0 is greedy (argmax, first index on ties). Otherwise the logits
are divided by the temperature, cut to the smallest set of most likely tokens whose
probability reaches top_p (the most likely token is always kept), and one token is drawn
by inverse-CDF with a uniform number derived from (seed, position) by splitmix64. So the
draw never depends on which other requests share the batch, on the rank, or on any global
RNG state; seed None draws from the process RNG (nondeterministic by design).
The math runs in float64, row by row in effect, so a row's result cannot depend on others.
"""

from __future__ import annotations

import random

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


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           seeds: list[int | None], positions: list[int]) -> list[int]:
    """logits [B, V] -> one token id per row. ``positions[i]`` is the position the sampled
    token will occupy in its sequence (its index counting from 0)."""
    B, V = logits.shape
    if not (len(temperatures) == len(top_ps) == len(seeds) == len(positions) == B):
        raise ValueError("sample() needs one temperature, top_p, seed and position per row")
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
