"""Request traces for the simulator: generated (Poisson, bursty on/off, heavy-tailed
lengths) or read from a JSONL file. A trace is a set of numpy arrays sorted by arrival.

All generators are deterministic functions of ``seed``.

* ``poisson``: exponential inter-arrival gaps at ``rate`` requests/s; prompt and output
  lengths log-normal (prompt median 384, output median 128).
* ``onoff``: on/off (a two-state Markov-modulated Poisson process). The cycle is
  ``BURST_PERIOD_S`` long; the first ``BURST_ON_FRACTION`` of it arrives at
  ``BURST_FACTOR × rate``, the rest at the rate that keeps the mean at ``rate``. Phases
  start at a random offset. Lengths as ``poisson``. This is the traffic that makes stale
  views and idle forwards show: a burst lands faster than snapshots refresh.
* ``heavy-tail``: Poisson arrivals, Pareto-tailed (alpha 1.3) prompt and output lengths:
  most requests are short, a few are long enough to dominate a rank.
* ``bursty``: the regime reviewers tried near capacity: a Poisson floor (half the requests)
  plus bursts of 100-400 requests landing within 20-40 ms; prompts Pareto-tailed up to
  16k tokens (median ~512), outputs log-normal (median 128).
* ``ramp``: a diurnal rise: the rate climbs from 0.2x to 1.8x the mean and back (a sine
  over the trace), prompts log-uniform 64-8,192 tokens, outputs log-normal (median 128).
* ``fixed``: Poisson arrivals, every request ``FIXED_PROMPT`` prompt and ``FIXED_OUTPUT``
  output tokens: vLLM ``benchmark_serving``'s random dataset at its defaults (1,024 in, 128
  out, range ratio 0), the shape most published benchmarks run. ``fixed:IN:OUT`` sets the
  two lengths (``fixed:4096:256``, as its ``--random-input-len`` / ``--random-output-len``).
* ``offline``: every request at t=0, lengths as ``poisson``.
* ``blog``: the TensorRT-LLM ADP Balance blog's offline set, every request at t=0: input
  mean 803, output mean 3,653 with a long tail (log-normal, sigma 0.6 / 0.9, capped at
  ``BLOG_PROMPT_MAX`` / ``BLOG_OUTPUT_MAX``; the medians are solved so that the capped
  means stay the blog's).

What a policy may know: every request carries the client's ``max_tokens`` (the cap),
never its true output length. Generated traces use ``max_model_len - prompt`` as the cap
(what OpenAI clients send when they set none: the server's limit); a JSONL trace may give
``max_tokens`` per line. Every request is clipped so that ``prompt + output <= max_model_len``
and ``output <= max_tokens``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORKLOADS = ("poisson", "bursty", "onoff", "heavy-tail", "ramp", "fixed", "offline", "blog")

PROMPT_MEDIAN, PROMPT_SIGMA = 384.0, 0.8
OUTPUT_MEDIAN, OUTPUT_SIGMA = 128.0, 0.7
FIXED_PROMPT, FIXED_OUTPUT = 1024, 128
BURST_PERIOD_S = 4.0
BURST_ON_FRACTION = 0.25
BURST_FACTOR = 3.0
PARETO_ALPHA = 1.3
# blog: the experiment ran with context chunking off and max_num_tokens 4608 (the blog's
# draft, bloc_x_adp-scheduler-opt.md), so no prompt is longer; its baseline ended at
# iteration 30,235 with contexts ending near 12,000, so no late request generates more than
# ~18-20k tokens: the output cap is fitted to that iteration count (docs/calibration.md)
BLOG_PROMPT_MAX = 4608
BLOG_OUTPUT_MAX = 20000


@dataclass(slots=True)
class Trace:
    t: np.ndarray              # arrival (seconds, float64, sorted)
    prompt: np.ndarray         # prompt tokens (int64, >= 1)
    output: np.ndarray         # true output tokens (int64, >= 1): unknown to every policy
    api: np.ndarray            # api-server index (int64)
    name: str = "trace"
    max_tokens: np.ndarray | None = None   # the client's cap (int64); None: max_model_len - prompt
    clipped: int = 0           # requests whose lengths were cut to fit max_model_len

    def caps(self, max_model_len: int) -> np.ndarray:
        """The client's max_tokens of every request."""
        if self.max_tokens is not None:
            return self.max_tokens
        return np.maximum(self.output, max_model_len - self.prompt)

    def __len__(self) -> int:
        return int(self.t.size)

    @property
    def output_tokens(self) -> int:
        return int(self.output.sum())

    def describe(self) -> dict:
        n = len(self)
        return {
            "name": self.name, "requests": n,
            "duration_s": float(self.t[-1] - self.t[0]) if n else 0.0,
            "prompt_tokens_mean": float(self.prompt.mean()) if n else 0.0,
            "output_tokens_mean": float(self.output.mean()) if n else 0.0,
            **({"clipped_requests": self.clipped} if self.clipped else {}),
        }


def _lengths(rng: np.random.Generator, n: int, median: float, sigma: float) -> np.ndarray:
    return np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, n))).astype(np.int64)


def _capped_median(mean: float, sigma: float, cap: float) -> float:
    """The median of a log-normal (``sigma``) whose values clipped at ``cap`` average
    ``mean``: E[min(X, C)] = e^(mu + s^2/2) Phi((ln C - mu - s^2)/s) + C (1 - Phi((ln C - mu)/s)),
    solved for mu by bisection (it grows with mu)."""
    def phi(z: float) -> float:
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    def capped_mean(mu: float) -> float:
        lc = math.log(cap)
        return (math.exp(mu + sigma ** 2 / 2) * phi((lc - mu - sigma ** 2) / sigma)
                + cap * (1.0 - phi((lc - mu) / sigma)))

    lo, hi = math.log(mean) - 10 * sigma, math.log(cap)
    if capped_mean(hi) < mean:
        raise ValueError(f"no log-normal capped at {cap} has mean {mean}")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_mean(mid) < mean else (lo, mid)
    return math.exp((lo + hi) / 2)


def _pareto(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(scale * (1.0 + rng.pareto(PARETO_ALPHA, n)))).astype(np.int64)


def _clip(prompt: np.ndarray, output: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = np.clip(prompt, 1, max(1, max_model_len - 1))
    output = np.clip(output, 1, np.maximum(1, max_model_len - prompt))
    return prompt, output


def _onoff_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    on_rate = BURST_FACTOR * rate
    off_rate = rate * (1.0 - BURST_FACTOR * BURST_ON_FRACTION) / (1.0 - BURST_ON_FRACTION)
    off_rate = max(off_rate, rate * 0.05)
    on_len, period = BURST_PERIOD_S * BURST_ON_FRACTION, BURST_PERIOD_S
    out = np.empty(n)
    t = float(rng.uniform(0, period))  # phase
    i = 0
    while i < n:
        phase = t % period
        on = phase < on_len
        r = on_rate if on else off_rate
        end = t - phase + (on_len if on else period)
        gap = rng.exponential(1.0 / r)
        if t + gap >= end:      # memoryless: restart the clock at the phase change
            t = end
            continue
        t += gap
        out[i] = t
        i += 1
    return out - out[0]


def _bursty_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Half the requests as a Poisson floor, half in bursts of 100-400 within 20-40 ms."""
    n_floor = n // 2
    span = n / rate
    floor = rng.uniform(0.0, span, n_floor)
    times = [floor]
    left = n - n_floor
    while left > 0:
        size = min(left, int(rng.integers(100, 401)))
        start = rng.uniform(0.0, span)
        times.append(start + rng.uniform(0.0, rng.uniform(0.02, 0.04), size))
        left -= size
    t = np.sort(np.concatenate(times))
    return t - t[0]


def _ramp_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Rate(t) = rate x (0.2 + 1.6 sin^2(pi t / D)) over D = n / rate: mean ``rate``,
    peak 1.8x (thinning a Poisson process at the peak rate)."""
    span = n / rate
    peak = 1.8 * rate
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(1.0 / peak)
        if t > span:
            t = 0.0
            continue
        lam = rate * (0.2 + 1.6 * np.sin(np.pi * t / span) ** 2)
        if rng.uniform() * peak <= lam:
            out.append(t)
    a = np.sort(np.asarray(out[:n]))
    return a - a[0]


def fixed_lengths(kind: str) -> tuple[int, int] | None:
    """(prompt, output) tokens of a ``fixed`` workload: ``fixed`` is FIXED_PROMPT /
    FIXED_OUTPUT, ``fixed:IN:OUT`` its own; None for every other kind. ValueError for a
    ``fixed:`` that does not name two positive whole numbers."""
    if kind == "fixed":
        return FIXED_PROMPT, FIXED_OUTPUT
    if not kind.startswith("fixed:"):
        return None
    parts = kind.split(":")[1:]
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"workload {kind!r}: write fixed:IN:OUT with two token counts > 0, e.g. fixed:4096:256")
    return int(parts[0]), int(parts[1])


def check_kind(kind: str) -> None:
    """ValueError, saying what to write, unless ``kind`` names a workload :func:`generate` makes."""
    if kind not in WORKLOADS and fixed_lengths(kind) is None:
        raise ValueError(f"unknown workload {kind!r}; choose one of: {', '.join(WORKLOADS)} "
                         "(or fixed:IN:OUT for other fixed lengths)")


def generate(kind: str, n: int, rate: float, seed: int, api_servers: int = 1,
             max_model_len: int = 4096) -> Trace:
    """A trace of ``n`` requests at a mean ``rate`` (requests/s; ignored by the offline ones)."""
    check_kind(kind)
    fixed = fixed_lengths(kind)
    if n < 1:
        raise ValueError("requests must be >= 1")
    if not (rate > 0 and math.isfinite(rate)):   # (NaN compares false)
        raise ValueError(f"rate must be a finite number > 0, not {rate!r}")
    rng = np.random.default_rng(seed)
    if kind == "onoff":
        t = _onoff_times(rng, n, rate)
    elif kind == "bursty":
        t = _bursty_times(rng, n, rate)
    elif kind == "ramp":
        t = _ramp_times(rng, n, rate)
    elif kind in ("offline", "blog"):
        t = np.zeros(n)
    else:
        t = np.cumsum(rng.exponential(1.0 / rate, n))
        t -= t[0]
    if kind == "heavy-tail":
        prompt = _pareto(rng, n, PROMPT_MEDIAN / 2 ** (1 / PARETO_ALPHA))
        output = _pareto(rng, n, OUTPUT_MEDIAN / 2 ** (1 / PARETO_ALPHA))
    elif kind == "bursty":
        prompt = np.minimum(_pareto(rng, n, 512 / 2 ** (1 / PARETO_ALPHA)), 16384)
        output = _lengths(rng, n, OUTPUT_MEDIAN, OUTPUT_SIGMA)
    elif kind == "ramp":
        prompt = np.rint(np.exp(rng.uniform(np.log(64), np.log(8192), n))).astype(np.int64)
        output = _lengths(rng, n, OUTPUT_MEDIAN, OUTPUT_SIGMA)
    elif fixed is not None:
        prompt = np.full(n, fixed[0], dtype=np.int64)
        output = np.full(n, fixed[1], dtype=np.int64)
    elif kind == "blog":
        # log-normal, capped, with the blog's means (803.1 / 3,653.8)
        prompt = np.minimum(_lengths(rng, n, _capped_median(803.1, 0.6, BLOG_PROMPT_MAX), 0.6),
                            BLOG_PROMPT_MAX)
        output = np.minimum(_lengths(rng, n, _capped_median(3653.8, 0.9, BLOG_OUTPUT_MAX), 0.9),
                            BLOG_OUTPUT_MAX)
    else:
        prompt = _lengths(rng, n, PROMPT_MEDIAN, PROMPT_SIGMA)
        output = _lengths(rng, n, OUTPUT_MEDIAN, OUTPUT_SIGMA)
    p0, o0 = prompt, output
    prompt, output = _clip(prompt, output, max_model_len)
    clipped = int(((prompt != p0) | (output != o0)).sum())
    api = rng.integers(0, max(1, api_servers), n).astype(np.int64)
    return Trace(t=t, prompt=prompt, output=output, api=api, name=kind, clipped=clipped)


TRACE_KEYS = ("t", "prompt_tokens", "output_tokens", "max_tokens", "api_server")


def _number(v: object, key: str) -> float:
    """A JSON number (a string or a boolean was read as one: "12", true)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{key} must be a number, not {json.dumps(v)}")
    return float(v)


def _whole(v: object, key: str) -> int:
    """A token count or index: a whole JSON number (10.7 was cut to 10 without a word)."""
    x = _number(v, key)
    if not x.is_integer():
        raise ValueError(f"{key} must be a whole number, not {json.dumps(v)}")
    return int(x)


def _near_misses(d: dict) -> None:
    """A key that is almost a known one (max_token) is a typo: its value would be ignored
    (the cap becoming the context's room without a word). Other keys are a trace's own."""
    import difflib
    for key in d:
        if key not in TRACE_KEYS:
            close = difflib.get_close_matches(key, TRACE_KEYS, n=1, cutoff=0.8)
            if close:
                raise ValueError(f"{key!r} is not a trace field: did you mean {close[0]!r}?")


def load_jsonl(path: str | Path, api_servers: int | None = 1, seed: int = 0,
               max_model_len: int = 4096) -> Trace:
    """Read ``{"t", "prompt_tokens", "output_tokens"[, "max_tokens", "api_server"]}`` per
    line. Requests without ``api_server`` are spread over the api-servers at random
    (seeded); without ``max_tokens`` the cap is ``max_model_len - prompt``. With
    ``api_servers=None`` (a replay that does not route by it) any index is kept as recorded
    and a line without one gets 0."""
    ts, ps, os_, apis, caps = [], [], [], [], []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise TypeError(f"a JSON object per line, not {type(d).__name__}")
            _near_misses(d)
            ts.append(_number(d["t"], "t"))
            ps.append(_whole(d["prompt_tokens"], "prompt_tokens"))
            os_.append(_whole(d["output_tokens"], "output_tokens"))
            apis.append(_whole(d["api_server"], "api_server") if "api_server" in d else -1)
            caps.append(_whole(d["max_tokens"], "max_tokens") if d.get("max_tokens") is not None else -1)
        except (ValueError, KeyError, TypeError, OverflowError) as exc:   # (1e400 tokens: OverflowError)
            raise ValueError(f"{path}:{lineno}: bad trace line ({exc})") from None
        if ps[-1] < 1 or os_[-1] < 1 or not (math.isfinite(ts[-1]) and ts[-1] >= 0):
            raise ValueError(f"{path}:{lineno}: t must be a finite number >= 0 and token counts >= 1")
        if max(ps[-1], os_[-1], caps[-1]) >= 1 << 40:   # past int64 arithmetic, and any model's context
            raise ValueError(f"{path}:{lineno}: token counts must be below 2^40")
        if d.get("max_tokens") is not None and caps[-1] < 1:
            raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1 (or left out: the context's room)")
        if "api_server" in d and apis[-1] < 0:
            raise ValueError(f"{path}:{lineno}: api_server must be >= 0 (or left out: spread at random)")
    if not ts:
        raise ValueError(f"{path}: empty trace")
    t = np.asarray(ts)
    # Times from 0: a trace stamped on a large clock (1.7e12 and up) gave other figures than
    # the same gaps from 0, and at 1e15 a poll could not advance the simulator's clock (it hung).
    t = t - t.min()
    order = np.argsort(t, kind="stable")
    rng = np.random.default_rng(seed)
    api = np.asarray(apis, dtype=np.int64)
    missing = api < 0
    api[missing] = rng.integers(0, max(1, api_servers or 1), int(missing.sum()))
    if api_servers is not None and (api >= api_servers).any():
        raise ValueError(f"{path}: api_server index >= --api-servers ({api_servers})")
    p0, o0, own = (np.asarray(x, dtype=np.int64) for x in (ps, os_, caps))
    prompt, output = _clip(p0, o0, max_model_len)
    cap = np.where(own > 0, np.minimum(own, max_model_len - prompt), max_model_len - prompt)
    output = np.minimum(output, np.maximum(1, cap))
    wanted = np.where(own > 0, np.minimum(o0, own), o0)   # the output the trace asks for, its own cap kept
    clipped = int(((prompt != p0) | (output < wanted)).sum())
    return Trace(t=t[order], prompt=prompt[order], output=output[order], api=api[order],
                 name=Path(path).name, max_tokens=np.maximum(1, cap)[order], clipped=clipped)


def dump_jsonl(trace: Trace, path: str | Path) -> None:
    with open(path, "w") as f:
        for i in range(len(trace)):
            f.write(json.dumps({"t": float(trace.t[i]), "prompt_tokens": int(trace.prompt[i]),
                                "output_tokens": int(trace.output[i]),
                                **({"max_tokens": int(trace.max_tokens[i])} if trace.max_tokens is not None else {}),
                                "api_server": int(trace.api[i])}) + "\n")
