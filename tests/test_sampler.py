"""Sampling: greedy at temperature 0, top_p cut, and seeded draws that are a function of
(seed, position) only, never of the batch around them."""

from __future__ import annotations

from collections import Counter

import torch

from services.engine_worker.batch import ChunkInput
from services.engine_worker.model import MoEConfig, TorchModelRunner
from services.engine_worker.model.sampler import sample, seeded_uniform

V = 16


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def _probs_logits(probs: list[float]) -> torch.Tensor:
    p = torch.tensor(probs + [0.0] * (V - len(probs))) + 1e-12
    return p.log()[None, :]


def test_temperature_zero_is_argmax_whatever_the_seed():
    logits = _rows(8)
    got = sample(logits, [0.0] * 8, [0.5] * 8, list(range(8)), list(range(8)))
    assert got == logits.argmax(-1).tolist()
    # ties resolve to the first index
    assert sample(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), [0.0], [1.0], [None], [0]) == [1]


def test_seeded_uniform_is_a_pure_function_of_seed_and_position():
    assert seeded_uniform(7, 100) == seeded_uniform(7, 100)
    values = [seeded_uniform(7, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert len(set(values)) == 2000
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert seeded_uniform(7, 3) != seeded_uniform(8, 3)
    assert 0.0 <= seeded_uniform(-5, 0) < 1.0                # negative seeds are fine


def test_seeded_draw_does_not_depend_on_the_batch():
    target = _rows(1, seed=42)
    alone = [sample(target, [0.8], [0.9], [1234], [p])[0] for p in range(25)]
    for batch_seed in range(2):
        others = _rows(5, seed=batch_seed)
        for p in range(25):
            # the same row at a different index, among other rows with other settings
            logits = torch.cat([others[:2], target, others[2:]])
            got = sample(logits, [1.0, 0.0, 0.8, 1.5, 0.7, 1.0], [1.0, 1.0, 0.9, 0.5, 0.95, 1.0],
                         [1, None, 1234, 99, None, 5], [p + 3, p, p, 9, p, 0])
            assert got[2] == alone[p]
    assert len(set(alone)) > 1            # different positions do draw differently


def test_top_p_keeps_the_smallest_nucleus():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    n = 600   # one row per position, all in one batch (rows never influence each other)
    draws = lambda top_p: Counter(sample(logits.expand(n, V), [1.0] * n, [top_p] * n, [3] * n, list(range(n))))
    assert set(draws(0.7)) == {0, 1}                 # 0.5 < 0.7 <= 0.8
    assert set(draws(0.5)) == {0}                    # the top token alone reaches 0.5
    assert set(draws(0.0)) == {0}                    # the top token is always kept
    assert set(draws(0.9)) == {0, 1, 2}
    full = draws(1.0)
    assert set(full) == {0, 1, 2, 3}
    for tok, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(full[tok] / 600 - p) < 0.06


def test_temperature_sharpens_and_unseeded_sampling_works():
    logits = _probs_logits([0.4, 0.35, 0.25])
    cold = Counter(sample(logits.expand(300, V), [0.01] * 300, [1.0] * 300, [11] * 300, list(range(300))))
    assert cold[0] > 290
    free = sample(_rows(4), [1.0] * 4, [1.0] * 4, [None] * 4, [0] * 4)
    assert all(0 <= t < V for t in free)


def test_runner_seeded_tokens_do_not_depend_on_batch_composition():
    cfg = MoEConfig()
    prompt = list(b"seeded sampling")
    mk = lambda: ChunkInput("s", prompt, 0, [0, 1, 2, 3], True, temperature=0.9, top_p=0.95, seed=77,
                            prompt_len=len(prompt))
    alone = TorchModelRunner(cfg, 0, 1, num_kv_blocks=16, block_size=4).run([mk()])["s"]
    crowd = TorchModelRunner(cfg, 0, 1, num_kv_blocks=16, block_size=4).run(
        [ChunkInput("x", list(b"other prompt"), 0, [8, 9, 10], True, temperature=1.0, seed=1), mk(),
         ChunkInput("y", [5], 0, [12], True, temperature=0.0)])
    assert crowd["s"] == alone
    assert set(crowd) == {"x", "s", "y"}
