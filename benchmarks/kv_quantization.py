"""Accuracy of a quantized KV cache by dtype and scale granularity (runs on a CPU).

For each K/V set, each quantized dtype (fp8 e4m3, fp8 e5m2, int8) and each of the kernels'
scale granularities (per tensor, KV head, page and head, token and head; pages of 16 tokens),
the pool is quantized with ``jpaged.kv.quantize.quantize`` and decode attention over it is
compared with f64 attention over the original values: the relative error of the output (max
|error| / max |output|, and its RMS over the RMS of the output, over many queries and
sequences), and of the keys and values themselves (RMS).

K/V sets:

- ``random``: unit normal keys and values;
- ``llm-like``: keys as LLMs' look (a few outlier channels 10-30x the others, per-token norms
  spread lognormally, an attention-sink first token of 20x norm), values normal with rare
  outlier tokens;
- ``demo-model``: the keys and values the shipped demo model (``jpaged.demo_model_path()``)
  writes into its cache for a batch of prompts, read back from the pool (queries: other
  tokens' keys, which share the keys' rotary space).

Queries are scaled so the logits spread with a standard deviation of 3 (``_realistic_logits``).

    python benchmarks/kv_quantization.py --out benchmarks/results/kv_quantization_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jpaged.kv import quantize

DTYPES = ("fp8", "fp8_e5m2", "int8")
GRANULARITIES = ("tensor", "head", "page", "token")
C = 16  # page size


def random_set(rng, K=8, S=1024, H=128):
    """(k [K, S, H], v [K, S, H], queries [Q, K, G, H]) unit normal."""
    k = rng.standard_normal((K, S, H))
    v = rng.standard_normal((K, S, H))
    return k, v, rng.standard_normal((16, K, 4, H))


def llm_like_set(rng, K=8, S=1024, H=128):
    """Keys with outlier channels, lognormal per-token norms and a sink token; values with rare
    outlier tokens."""
    k = rng.standard_normal((K, S, H))
    for h in range(K):
        ch = rng.choice(H, size=4, replace=False)
        k[h, :, ch] *= rng.uniform(10, 30, size=(4, 1))
    k *= rng.lognormal(0.0, 0.5, size=(K, S, 1))
    k[:, 0] *= 20.0  # attention sink
    v = rng.standard_normal((K, S, H))
    outliers = rng.random((K, S)) < 0.01
    v[outliers] *= 15.0
    q = rng.standard_normal((16, K, 4, H))
    q[..., :] *= np.std(k, axis=(1,))[None, :, None, :] / np.std(k)  # aligned with the keys
    q[:, :, :, :] += 0.5 * k[None, :, :1, :] / np.abs(k[:, :1]).max()  # drawn to the sink
    return k, v, q


def demo_model_set(rng, max_tokens=1024):
    """The demo model's K/V of one layer as its cache holds them after generating."""
    import jpaged

    llm = jpaged.LLM(jpaged.demo_model_path(), page_size=C, max_model_len=64, num_pages=256)
    prompts = [f"{a}+{b}=" for a, b in rng.integers(0, 1000, size=(48, 2))]
    llm.generate(prompts, jpaged.SamplingParams(max_tokens=6, temperature=0.0))
    kp = np.asarray(llm.cache.k_pages, np.float64)  # [L, K, P, C, H]
    vp = np.asarray(llm.cache.v_pages, np.float64)
    used = np.abs(kp).sum(axis=(0, 1, 3, 4)) > 0  # pages written
    L, K, _, _, H = kp.shape
    k = kp[:, :, used].reshape(L, K, -1, H)[:, :, :max_tokens]
    v = vp[:, :, used].reshape(L, K, -1, H)[:, :, :max_tokens]
    k = np.concatenate(list(k), axis=0)  # layers as heads: [L * K, S, H]
    v = np.concatenate(list(v), axis=0)
    S = k.shape[1]
    pick = rng.integers(0, S, size=16)
    q = np.stack([k[:, i] for i in pick])[:, :, None, :]  # [Q, K', 1, H]
    return k, v, q


def attention(q, k, v, lengths):
    """f64 decode attention: q [Q, K, G, H] over the first ``lengths[i]`` keys of k, v."""
    H = q.shape[-1]
    outs = []
    for i, n in enumerate(lengths):
        s = np.einsum("kgh,ksh->kgs", q[i], k[:, :n]) / np.sqrt(H)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        outs.append(np.einsum("kgs,ksh->kgh", p, v[:, :n]))
    return np.stack(outs)


def _pool(x):
    """[K, S, H] -> [K, P, C, H] (S padded with zeros to whole pages)."""
    K, S, H = x.shape
    P = -(-S // C)
    return np.pad(x, ((0, 0), (0, P * C - S), (0, 0))).reshape(K, P, C, H), S


def _realistic_logits(q, k, std: float = 3.0):
    """``q`` scaled so the logits ``q . k / sqrt(H)`` spread with standard deviation ``std``
    (a trained model's attention logits span a few units; unscaled proxies with outlier
    channels would give logits in the hundreds, where any rounding flips the softmax)."""
    s = np.einsum("qkgh,ksh->qkgs", q, k) / np.sqrt(q.shape[-1])
    return q * (std / s.std())


def measure(k, v, q, rng) -> dict:
    q = _realistic_logits(q, k)
    lengths = rng.integers(k.shape[1] // 4, k.shape[1] + 1, size=q.shape[0])
    ref = attention(q, k, v, lengths)
    out: dict = {}
    for name in DTYPES:
        dtype = quantize.kv_dtype(name)
        for gran in GRANULARITIES:
            deq = []
            for x in (k, v):
                pool, S = _pool(x)
                pages, scale = quantize.quantize(jnp.asarray(pool, jnp.float32), dtype, gran)
                back = np.asarray(quantize.dequantize(pages, scale), np.float64)
                deq.append(back.reshape(x.shape[0], -1, x.shape[2])[:, :S])
            got = attention(q, deq[0], deq[1], lengths)
            err = got - ref
            out[f"{name}/{gran}"] = {
                "out_max_rel": float(np.abs(err).max() / np.abs(ref).max()),
                "out_rms_rel": float(np.sqrt((err**2).mean() / (ref**2).mean())),
                "k_rms_rel": float(np.sqrt(((deq[0] - k) ** 2).mean() / (k**2).mean())),
                "v_rms_rel": float(np.sqrt(((deq[1] - v) ** 2).mean() / (v**2).mean())),
            }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", nargs="*", default=["random", "llm-like", "demo-model"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    builders = {"random": random_set, "llm-like": llm_like_set, "demo-model": demo_model_set}
    results = {}
    for name in ns.sets:
        rng = np.random.default_rng(ns.seed)
        k, v, q = builders[name](rng)
        results[name] = measure(k, v, q, rng)
        print(f"\n{name}: K/V {k.shape}, queries {q.shape[0]}")
        print(
            f"  {'dtype/granularity':<22} {'out max':>9} {'out rms':>9} {'K rms':>9} {'V rms':>9}"
        )
        for key, r in results[name].items():
            print(
                f"  {key:<22} {r['out_max_rel']:9.2e} {r['out_rms_rel']:9.2e} "
                f"{r['k_rms_rel']:9.2e} {r['v_rms_rel']:9.2e}"
            )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "page_size": C,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
