"""The bundled model (`lockstep up` with no --model) answers readable text: a byte-level
Qwen3-MoE trained by scripts/train-bundled-model on Python's own docstrings, loaded through
the same checkpoint path as any real model. The seeded random model stays as 'random'."""

from __future__ import annotations

import re

import pytest

from services.engine_worker.batch import ChunkInput
from services.engine_worker.model.factory import BUNDLED_DIR, make_runner
from services.engine_worker.model.hf_config import HFConfig
from services.engine_worker.model.model import MoETransformer
from shared.settings import EngineSettings
from shared.tokenizer import VOCAB_SIZE, decode, encode

COMMON = {"the", "a", "an", "of", "to", "is", "and", "in", "for", "if", "or", "be", "as", "it", "this", "that", "with",
          "not", "by", "on", "are", "return", "returns", "object", "file", "string", "value", "list", "default"}


def readable(text: str) -> bool:
    """Printable ASCII lines made mostly of words, several of them common English ones."""
    if not text or any(not (c.isprintable() or c == "\n") or ord(c) > 126 for c in text):
        return False
    words = re.findall(r"[A-Za-z]+", text)
    letters = sum(len(w) for w in words)
    return letters >= 0.6 * len(text.replace(" ", "").replace("\n", "")) and len({w.lower() for w in words} & COMMON) >= 2


def greedy(runner, prompt: str, n: int) -> str:
    toks = encode(prompt)
    table = list(range(8))
    out = runner.run([ChunkInput("s", toks, 0, table, True, temperature=0.0)])["s"]
    gen = [out]
    for i in range(n - 1):
        gen.append(runner.run([ChunkInput("s", [gen[-1]], len(toks) + i, table, True, temperature=0.0)])["s"])
    return decode(gen)


def test_the_default_torch_model_is_the_trained_bundled_checkpoint_and_reads_as_text():
    assert (BUNDLED_DIR / "model.safetensors").is_file() and (BUNDLED_DIR / "README.md").is_file()
    runner = make_runner(EngineSettings(ranks=1, backend="torch", num_kv_blocks=8, block_size=16, max_model_len=128), 0)
    assert isinstance(runner.config, HFConfig) and runner.config.vocab_size == VOCAB_SIZE
    answer = greedy(runner, "<|user|>\nWhat does json.dumps do?\n<|assistant|>\n", 60)
    assert readable(answer), answer
    assert readable(greedy(runner, "Return the", 40))
    noise = make_runner(EngineSettings(ranks=1, backend="torch", num_kv_blocks=8, block_size=16, max_model_len=128, model="random"), 0)
    assert isinstance(noise.model, MoETransformer)
    assert not readable(greedy(noise, "<|user|>\nWhat does json.dumps do?\n<|assistant|>\n", 60))   # the check can fail


@pytest.mark.slow
def test_lockstep_up_without_a_model_answers_readable_text(tmp_path):
    import openai

    from tests.conftest import start_cluster

    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "1", "--spares", "0", namespace="bundled")
    try:
        client = openai.OpenAI(base_url=cluster.api_url, api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="lockstep-moe", temperature=0, max_tokens=60,
                                           messages=[{"role": "user", "content": "What does os.path.join do?"}])
        assert readable(r.choices[0].message.content), r.choices[0].message.content
        # its turns end where it opens the next turn's tag (it ran to max_tokens: it never saw EOS)
        ends = [client.chat.completions.create(model="lockstep-moe", temperature=0, max_tokens=200,
                                               messages=[{"role": "user", "content": q}]).choices[0]
                for q in ("hi", "What does time.sleep do?", "Explain os.getcwd.")]
        assert "stop" in [c.finish_reason for c in ends], [c.message.content for c in ends]
        assert all("\n<|" not in c.message.content for c in ends)
    finally:
        cluster.stop()
