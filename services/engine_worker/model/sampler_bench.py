"""What the sampler's per-request extras cost per step (scripts/bench-sampler): plain
sampling, a grammar mask on every row (structured output), logprobs with the top 5, and
one llguidance mask; min of 5 runs, in the byte vocabulary."""

from __future__ import annotations

import time

import torch

from services.engine_worker.model.sampler import RowExtra, logprobs, sample
from shared import grammar
from shared.tokenizer import VOCAB_SIZE


def _ms(f, n: int = 200) -> float:
    best = float("inf")
    for _ in range(5):
        f()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    return best


def main(rows: int = 32) -> None:
    torch.set_num_threads(1)
    lg = torch.randn(rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    m = grammar.matcher("json", '{"type": "object"}')
    mask = m.compute_bitmask()
    args = ([1.0] * rows, [1.0] * rows, [1] * rows, [5] * rows)
    print(f"rows {rows}, vocab {VOCAB_SIZE}")
    print(f"sample:                           {_ms(lambda: sample(lg, *args)):.3f} ms")
    print(f"sample, grammar mask on each row: {_ms(lambda: sample(lg, *args, [RowExtra(allowed=mask)] * rows)):.3f} ms")
    print(f"logprobs, top 5 of each row:      {_ms(lambda: logprobs(lg, [1] * rows, [5] * rows)):.3f} ms")
    print(f"one llguidance mask:              {_ms(lambda: m.compute_bitmask(), 2000) * 1000:.1f} us")


if __name__ == "__main__":
    main()
