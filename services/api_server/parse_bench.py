"""What parsing one request costs the api-server: the body's bytes to a ParsedRequest
(decode, validate, map into SamplingParams), for a typical chat and completion body.

    python -m services.api_server.parse_bench

Compare two commits by running it with PYTHONPATH=<a worktree of each>. A tree from
before the msgspec bodies (62c8954) parses a dict: it is timed with orjson.loads of
the same bytes, as its handler paid it.
"""

from __future__ import annotations

import statistics
import timeit

import orjson

from services.api_server import protocol

CHAT = orjson.dumps({"model": "m", "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a haiku about load balancers and mixture-of-experts serving."}],
    "max_tokens": 64, "temperature": 0.7, "top_p": 0.95, "stream": True,
    "stream_options": {"include_usage": True}, "seed": 1, "stop": ["\n\n"]})
COMPLETION = orjson.dumps({"model": "m", "prompt": "Once upon a time, in a land of many experts,", "max_tokens": 32,
                           "temperature": 0.0, "top_k": 20, "repetition_penalty": 1.1, "logprobs": 2,
                           "ignore_eos": True})


def _takes_bytes() -> bool:
    try:
        protocol.parse(CHAT, "chat", served_model="m", max_model_len=4096, num_ranks=2)
        return True
    except Exception:  # noqa: BLE001 - an older tree: "the request body must be a JSON object"
        return False


def main(number: int = 20000, repeat: int = 7) -> None:
    raw_ok = _takes_bytes()

    def parse(raw: bytes, kind: str) -> None:
        protocol.parse(raw if raw_ok else orjson.loads(raw), kind, served_model="m", max_model_len=4096,
                       num_ranks=2)

    print("parse takes", "bytes" if raw_ok else "a dict (orjson.loads timed with it)")
    for name, raw, kind in (("chat", CHAT, "chat"), ("completion", COMPLETION, "completion")):
        parse(raw, kind)
        ts = [t / number * 1e6 for t in timeit.repeat(lambda: parse(raw, kind), number=number, repeat=repeat)]
        print(f"{name:10s} {min(ts):6.2f} us min  {statistics.median(ts):6.2f} us median  (per request)")


if __name__ == "__main__":
    main()
