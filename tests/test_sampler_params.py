"""Issue #15: top_k, min_p and the repetition / presence / frequency penalties take effect in
the torch backend's sampler, and travel from the api-server's parser to the engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.api_server.protocol import parse
from services.engine_worker.batch import ChunkInput
from services.engine_worker.model import MoEConfig, TorchModelRunner
from services.engine_worker.model.sampler import RowExtra, sample
from shared.messages import SamplingParams

V = 16


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(logits: torch.Tensor, extra: RowExtra | None, n: int = 400, temperature: float = 1.0) -> Counter:
    row = logits[:1]
    return Counter(sample(row, [temperature], [1.0], [11], [p], [extra])[0] for p in range(n))


def test_top_k_1_is_greedy():
    logits = _rows(8)
    greedy = logits.argmax(-1).tolist()
    for pos in range(20):
        got = sample(logits, [1.5] * 8, [1.0] * 8, [pos] * 8, [pos] * 8, [RowExtra(top_k=1)] * 8)
        assert got == greedy


def test_top_k_keeps_only_the_k_most_likely():
    logits = _rows(1, seed=3)
    top3 = set(logits[0].topk(3).indices.tolist())
    seen = set(_draws(logits, RowExtra(top_k=3), temperature=2.0))
    assert seen <= top3 and len(seen) == 3
    assert len(set(_draws(logits, None, temperature=2.0))) > 3          # without it, more come out


def test_min_p_cuts_unlikely_tokens():
    p = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04] + [0.0] * (V - 5)) + 1e-12
    logits = p.log()[None, :]
    seen = set(_draws(logits, RowExtra(min_p=0.25)))          # keeps p >= 0.125: tokens 0 and 1
    assert seen == {0, 1}
    assert set(_draws(logits, RowExtra(min_p=1.0))) == {0}
    assert len(set(_draws(logits, None))) == 5


def test_presence_penalty_changes_a_repeated_token():
    logits = torch.zeros(1, V)
    logits[0, 4] = 3.0
    logits[0, 7] = 2.5
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(output=[4, 4])]) == [4]   # no penalty: 4
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(presence_penalty=1.0, output=[4])]) == [7]
    # greedy rows are penalized too, and only generated tokens count for presence
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(presence_penalty=1.0, prompt=[4])]) == [4]


def test_frequency_penalty_scales_with_count():
    logits = torch.zeros(1, V)
    logits[0, 4] = 3.0
    logits[0, 7] = 2.5
    once = RowExtra(frequency_penalty=0.4, output=[4])
    twice = RowExtra(frequency_penalty=0.4, output=[4, 4])
    assert sample(logits, [0.0], [1.0], [None], [0], [once]) == [4]      # 3.0 - 0.4 > 2.5
    assert sample(logits, [0.0], [1.0], [None], [0], [twice]) == [7]     # 3.0 - 0.8 < 2.5
    neg = RowExtra(frequency_penalty=-2.0, output=[7])                    # negative: encourages repeats
    assert sample(logits, [0.0], [1.0], [None], [0], [neg]) == [7]


def test_repetition_penalty_counts_prompt_and_output():
    logits = torch.zeros(1, V)
    logits[0, 4] = 3.0
    logits[0, 7] = 2.0
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(repetition_penalty=2.0, prompt=[4])]) == [7]
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(repetition_penalty=2.0, output=[4])]) == [7]
    assert sample(logits, [0.0], [1.0], [None], [0], [RowExtra(repetition_penalty=1.2, prompt=[4])]) == [4]
    neg = torch.full((1, V), -1.0)
    neg[0, 2] = -0.5
    neg[0, 3] = -0.6
    # a negative logit is multiplied: seen token 2 falls below unseen 3
    assert sample(neg, [0.0], [1.0], [None], [0], [RowExtra(repetition_penalty=1.5, prompt=[2])]) == [3]


def test_neutral_extras_change_nothing():
    logits = _rows(6, seed=5)
    base = [sample(logits, [0.8] * 6, [0.9] * 6, [1] * 6, [p] * 6) for p in range(30)]
    neutral = [sample(logits, [0.8] * 6, [0.9] * 6, [1] * 6, [p] * 6, [RowExtra(output=[1, 2])] * 6)
               for p in range(30)]
    assert base == neutral


def test_extras_of_one_row_do_not_touch_the_others():
    logits = _rows(4, seed=9)
    plain = sample(logits, [1.0] * 4, [1.0] * 4, [3] * 4, [5] * 4)
    mixed = sample(logits, [1.0] * 4, [1.0] * 4, [3] * 4, [5] * 4,
                   [None, RowExtra(top_k=1, presence_penalty=2.0, output=[1]), None, None])
    assert [mixed[i] for i in (0, 2, 3)] == [plain[i] for i in (0, 2, 3)]


def test_runner_applies_extras_torch_backend():
    """Through the torch model: top_k=1 at temperature 1.5 is greedy, and a large presence
    penalty on the greedy token moves the pick."""
    cfg = MoEConfig(seed=0)
    runner = TorchModelRunner(cfg, 0, 1, num_kv_blocks=16, block_size=16)
    prompt = list(b"the lockstep")
    ch = lambda sid, **kw: ChunkInput(sid, prompt, 0, [int(sid[-1])], True, **kw)  # noqa: E731
    greedy = runner.run([ch("s0", temperature=0.0)])["s0"]
    for seed in range(8):
        got = runner.run([ch("s1", temperature=1.5, seed=seed)], {"s1": RowExtra(top_k=1)})["s1"]
        assert got == greedy
    moved = runner.run([ch("s2", temperature=0.0)], {"s2": RowExtra(presence_penalty=100.0, output=[greedy])})["s2"]
    assert moved != greedy


def test_params_travel_from_the_request_to_the_wire():
    p = parse({"model": "m", "prompt": "x", "top_k": 4, "min_p": 0.2, "presence_penalty": 1.0,
               "frequency_penalty": 0.5, "repetition_penalty": 1.1}, "completion", served_model="m",
              max_model_len=64, num_ranks=1).params
    back = SamplingParams.from_dict(p.to_dict())
    assert (back.top_k, back.min_p, back.presence_penalty, back.frequency_penalty, back.repetition_penalty) == \
        (4, 0.2, 1.0, 0.5, 1.1)
    # defaults stay off the wire, and an older document (without the new keys) reads as neutral
    d = SamplingParams().to_dict()
    assert set(d) == {"mt", "te", "tp", "sd", "st", "ie"}
    old = SamplingParams.from_dict(d)
    assert (old.top_k, old.min_p, old.penalized) == (-1, 0.0, False)


def test_worker_hands_the_runner_each_sequences_extras():
    from types import SimpleNamespace

    from services.engine_worker.sequence import Sequence
    from services.engine_worker.forward import sampling_extras

    seqs = {"a": Sequence("a", [1, 2], SamplingParams(presence_penalty=1.0), generated=[3]),
            "b": Sequence("b", [1], SamplingParams()),
            "c": Sequence("c", [1], SamplingParams(top_k=2))}
    core = SimpleNamespace(get=seqs.get)
    chunks = [ChunkInput(s, [1], 0, [0], True) for s in ("a", "b", "c")] + [ChunkInput("d", [1], 0, [0], False)]
    got = sampling_extras(core, chunks)
    assert set(got) == {"a", "c"}
    assert (got["a"].presence_penalty, got["a"].prompt, got["a"].output) == (1.0, [1, 2], [3])
    assert got["c"].top_k == 2 and got["c"].output == []
    assert sampling_extras(core, chunks[1:2]) is None


@pytest.mark.slow
def test_live_torch_cluster_applies_them(tmp_path):
    """End to end on `--backend torch`: top_k=1 at temperature 1.5 equals greedy, and a large
    presence penalty forbids repeating any generated token."""
    import openai

    from tests.conftest import start_cluster

    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--backend", "torch", "--spares", "0",
                            namespace="samp")
    try:
        c = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="lockstep-moe", prompt="the lockstep scheduler", max_tokens=12, extra_body={"ignore_eos": True})
        greedy = c.completions.create(temperature=0.0, **kw).choices[0].text
        for seed in (1, 2):
            topk1 = c.completions.create(temperature=1.5, seed=seed, **{**kw, "extra_body": {
                "ignore_eos": True, "top_k": 1}}).choices[0].text
            assert topk1 == greedy
        r = c.completions.create(temperature=0.0, presence_penalty=2.0, **{**kw, "extra_body": {
            "ignore_eos": True, "repetition_penalty": 2.0}})
        assert len(set(greedy)) < len(greedy), greedy          # greedy repeats itself ...
        assert r.choices[0].text != greedy                       # ... the penalties change that
        c.close()
    finally:
        cluster.stop()
