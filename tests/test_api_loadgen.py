"""Issue #15: a third-party load generator (guidellm, pinned in the test extra) against a
live 2-replica cluster: its report shows no error and exact token counts, and the
cluster's aggregated /metrics agree with it. guidellm sizes its synthetic prompts with a
tokenizer: a local Hugging Face tokenizer with one token per byte, i.e. lockstep's own
count, so "exact" means exactly what was asked (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
REQUESTS, PROMPT, OUTPUT = 20, 32, 8


def byte_tokenizer(out: Path) -> None:
    """A fast tokenizer whose token ids are the UTF-8 bytes (GPT-2's byte-to-symbol map, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    for b in range(256):
        if b not in bs:           # the unprintable bytes map to symbols past 255, in order
            cs.append(256 + len(bs) - 188)
            bs.append(b)
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    vocab["<|eos|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.save_pretrained(out)
    assert fast("héllo")["input_ids"] == list("héllo".encode())


def test_guidellm_report_exact(tmp_path):
    from tests.conftest import start_cluster

    exe = shutil.which("guidellm")
    assert exe, "guidellm is in the test extra (pyproject.toml)"
    byte_tokenizer(tmp_path / "tok")
    cluster = start_cluster(tmp_path, "--ranks", "2", "--api-servers", "2", "--backend", "sim", namespace="gl")
    try:
        root = cluster.api_url.rsplit("/v1", 1)[0]
        report = tmp_path / "report.json"
        spec = {"backend": {"kind": "openai_http", "target": root, "model": "lockstep-moe",
                            "request_format": "/v1/completions"},
                "profile": {"kind": "concurrent", "streams": 4},
                "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT, "output_tokens": OUTPUT}],
                "tokenizer": {"kind": "hf_auto", "model": str(tmp_path / "tok")},
                "constraints": [{"kind": "max_requests", "count": REQUESTS}],
                "outputs": [{"kind": "json", "path": str(report)}]}
        scenario = tmp_path / "scenario.json"
        scenario.write_text(json.dumps({"metadata": {"name": "lockstep"}, "spec": spec}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        run = subprocess.run([exe, "run", "--scenario", str(scenario), "--disable-console"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=240, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        bench = json.loads(report.read_text())["benchmarks"][0]
        totals = bench["metrics"]["request_totals"]
        assert (totals["successful"], totals["errored"], totals["incomplete"]) == (REQUESTS, 0, 0), totals
        for r in bench["requests"]["successful"]:
            assert (r["prompt_tokens"], r["output_tokens"]) == (PROMPT, OUTPUT), r["request_id"]
        # The server's side, whichever replica answers the scrape: guidellm may send a few
        # requests beyond those it reports (a backend check, ones past its limit), so the
        # server must count at least those, every one exactly PROMPT in and OUTPUT out.
        text = httpx.get(root + "/metrics", timeout=10).text
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
        m = (("model_name", "lockstep-moe"),)
        served = got[("vllm:request_success_total", (("finished_reason", "length"), *m))]
        assert served >= REQUESTS
        assert got[("vllm:prompt_tokens_total", m)] == served * PROMPT
        assert got[("vllm:generation_tokens_total", m)] == served * OUTPUT
    finally:
        cluster.stop()
