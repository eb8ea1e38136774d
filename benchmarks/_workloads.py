"""Serving workloads: seeded request-length distributions, Poisson arrivals, JSON traces.

The vLLM paper (Kwon et al., SOSP'23, section 6.1 and Fig. 11) synthesises requests from the
prompt and output lengths of two datasets and draws arrival times from a Poisson process. The
datasets themselves are not redistributed here; instead each is modelled by independent
log-normal prompt and output lengths whose **means are the paper's** (Fig. 11, OPT tokenizer):

============  ===========  ===========  ========================================
name          prompt mean  output mean  sigma of log(length), prompt / output
============  ===========  ===========  ========================================
``sharegpt``  161.31       337.99       1.0 / 0.8  (our choice: "higher variance")
``alpaca``    19.31        58.45        0.6 / 0.7  (our choice)
============  ===========  ===========  ========================================

The sigmas are not fitted to the datasets: they only give ShareGPT the wider spread the paper
describes. Lengths are clipped to ``[1, max_len - 1]`` (prompt) and so that prompt + output
<= ``max_len`` (the paper's 2048), which lowers the means slightly; `summary` reports the
sampled means. ``scale`` multiplies both means (tiny-model smoke runs use e.g. 1/8). A real
trace (e.g. lengths tokenised from ShareGPT) can be supplied as JSON instead (`read_trace`).

Trace JSON: ``{"format": "jpaged-trace-v1", "meta": {...}, "requests": [{"prompt_len": int,
"output_len": int, "arrival_s": float}, ...]}`` (``arrival_s`` optional, default 0).

>>> trace = make_trace("alpaca", 4, rate=2.0, seed=0)
>>> [r.prompt_len > 0 and r.output_len > 0 for r in trace]
[True, True, True, True]
>>> all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:]))
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

TRACE_FORMAT = "jpaged-trace-v1"

try:  # progress bars for the benchmarks (tqdm is a jpaged dependency; a bare machine may lack it)
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover

    class tqdm:
        """A silent stand-in with the part of tqdm's API the benchmarks use."""

        def __init__(self, iterable=None, total=None, **kwargs):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

        def update(self, n=1):
            pass

        def close(self):
            pass

        def write(self, s):
            print(s)


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a trace.

    Attributes:
      prompt_len: prompt tokens (>= 1).
      output_len: tokens to generate (>= 1), enforced (EOS ignored).
      arrival_s: arrival time in seconds from the start of the run.
    """

    prompt_len: int
    output_len: int
    arrival_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """Independent log-normal prompt and output lengths with the given means."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float


DISTRIBUTIONS: dict[str, LengthDist] = {
    "sharegpt": LengthDist(prompt_mean=161.31, prompt_sigma=1.0, output_mean=337.99,
                           output_sigma=0.8),
    "alpaca": LengthDist(prompt_mean=19.31, prompt_sigma=0.6, output_mean=58.45,
                         output_sigma=0.7),
}  # fmt: skip


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma^2))] = mean
    return rng.lognormal(mu, sigma, n)


def sample_lengths(
    name: str, num: int, *, seed: int = 0, max_len: int = 2048, scale: float = 1.0
) -> list[tuple[int, int]]:
    """``num`` (prompt_len, output_len) pairs from the named distribution (see module doc).

    Raises:
      ValueError: unknown ``name``, ``num < 1``, ``max_len < 2`` or ``scale <= 0``.
    """
    if name not in DISTRIBUTIONS:
        raise ValueError(f"{name=} must be one of {sorted(DISTRIBUTIONS)}")
    if num < 1 or max_len < 2 or not scale > 0:
        raise ValueError(f"{num=} must be >= 1, {max_len=} >= 2 and {scale=} > 0")
    d = DISTRIBUTIONS[name]
    rng = np.random.default_rng(seed)
    p = _lognormal(rng, d.prompt_mean * scale, d.prompt_sigma, num)
    o = _lognormal(rng, d.output_mean * scale, d.output_sigma, num)
    p = np.clip(np.round(p), 1, max_len - 1).astype(int)
    o = np.clip(np.round(o), 1, max_len - p).astype(int)
    return [(int(a), int(b)) for a, b in zip(p, o, strict=True)]


def poisson_arrivals(num: int, rate: float, *, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s; ``inf``: all at 0.

    Raises:
      ValueError: ``rate <= 0``.
    """
    if not rate > 0:
        raise ValueError(f"{rate=} must be > 0 requests/s (inf: all requests at once)")
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0


def with_arrivals(trace: Sequence[RequestSpec], rate: float, *, seed: int = 0) -> list[RequestSpec]:
    """The same requests (same lengths) with fresh Poisson arrivals at ``rate``."""
    times = poisson_arrivals(len(trace), rate, seed=seed)
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, times, strict=True)]


def make_trace(
    name: str,
    num: int,
    *,
    rate: float = math.inf,
    seed: int = 0,
    max_len: int = 2048,
    scale: float = 1.0,
) -> list[RequestSpec]:
    """``num`` requests with lengths from ``name`` and Poisson arrivals at ``rate``."""
    lengths = sample_lengths(name, num, seed=seed, max_len=max_len, scale=scale)
    trace = [RequestSpec(p, o) for p, o in lengths]
    return with_arrivals(trace, rate, seed=seed + 1)


def prompt_tokens(trace: Sequence[RequestSpec], vocab_size: int, *, seed: int = 0) -> list:
    """Seeded random prompt token ids (in ``[0, vocab_size)``) for every request."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, r.prompt_len).tolist() for r in trace]


def summary(trace: Sequence[RequestSpec]) -> dict:
    """Counts and means of a trace (what a benchmark's JSON records about its workload)."""
    p = np.asarray([r.prompt_len for r in trace])
    o = np.asarray([r.output_len for r in trace])
    return {
        "num_requests": len(trace),
        "prompt_mean": float(p.mean()),
        "prompt_max": int(p.max()),
        "output_mean": float(o.mean()),
        "output_max": int(o.max()),
    }


def write_trace(path: str | pathlib.Path, trace: Sequence[RequestSpec], meta: dict | None = None):
    """Writes ``trace`` as JSON (the format in the module docstring)."""
    doc = {
        "format": TRACE_FORMAT,
        "meta": meta or {},
        "requests": [dataclasses.asdict(r) for r in trace],
    }
    pathlib.Path(path).write_text(json.dumps(doc, indent=1))


def read_trace(path: str | pathlib.Path) -> list[RequestSpec]:
    """Reads a JSON trace (the format in the module docstring, or a bare list of requests).

    Raises:
      ValueError: a request lacks ``prompt_len``/``output_len``, or a length is < 1.
    """
    doc = json.loads(pathlib.Path(path).read_text())
    rows = doc["requests"] if isinstance(doc, dict) else doc
    trace, errors = [], []
    for i, r in enumerate(rows):
        try:
            spec = RequestSpec(int(r["prompt_len"]), int(r["output_len"]),
                               float(r.get("arrival_s", 0.0)))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            errors.append(f"requests[{i}]={r!r}: needs int prompt_len and output_len ({e})")
            continue
        if spec.prompt_len < 1 or spec.output_len < 1:
            errors.append(f"requests[{i}]: prompt_len and output_len must be >= 1, got {r!r}")
        trace.append(spec)
    if errors:
        raise ValueError(f"bad trace {path}: " + "; ".join(errors[:5]))
    return sorted(trace, key=lambda r: r.arrival_s)
