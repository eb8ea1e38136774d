"""Tensor parallelism: decode step time, MBU per device and the collectives' share, TP=1 vs TP=n.

For each tensor parallel size in ``--tp`` (sizes above the device count are skipped, so TP=1
runs on one device) and each batch size B (every sequence ``--ctx`` tokens in the cache,
greedy, ``--k`` steps per loop call), in one process:

- ``step_ms``: back-to-back calls of the engine's jitted decode loop (``Runner.decode_loop``)
  on a fixed batch, one sync at the end: device time per decode step (decode_step.py's
  floor). TP=1 is the one-device engine; TP=n the model split over the first n devices.
- ``mbu``: bytes one device reads per step (its block of the weights, the embedding table
  only when tied, and its KV heads of the live tokens) / step time / the HBM read roofline
  measured on device 0.
- ``collective_ms``: the step's collectives timed alone on the same devices: ``2L`` f32
  all-reduces of ``[B, D]`` (attention and MLP outputs of every layer: the split model sums
  its partial sums in f32), one of the embedding (model dtype) and one all-gather of the
  ``[B, V]`` f32 logits, each in a loop of its own;
  ``collective_share`` = collective_ms / step_ms.
- ``predicted_ms``: docs/parallel.md's model: bytes per device / roofline + collective_ms.

``--check`` first compares greedy tokens at every TP size with TP=1: the trained demo model
(``jpaged.demo_model_path()``, addition prompts) and the test checkpoints
(``tests/checkpoints``, transformers' goldens), in f32 and bf16.

    python benchmarks/diagnostics/tensor_parallel.py --model llama-8b --tp 1,2 --batch 64,256 --check
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent.parent  # benchmarks/
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import serving  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jpaged  # noqa: E402
from jpaged.engine.batches import LoopBatch, SamplingArrays  # noqa: E402
from jpaged.parallel import TensorParallelModel, make_mesh, shard_model  # noqa: E402

CHECKPOINTS = ("llama2", "llama3", "mistral", "qwen2")


def device_weight_bytes(model) -> int:
    """Parameter bytes one device reads per decode step: its block of every array (the
    embedding table only when tied: otherwise a step gathers B rows of it)."""
    tied = model.config.tie_word_embeddings
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        name = ".".join(str(getattr(k, "key", "")) for k in path)
        if "embed_VD" in name and not tied:
            continue
        shape = x.sharding.shard_shape(x.shape) if hasattr(x, "sharding") else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def kv_bytes_per_token(model, itemsize: int) -> int:
    """K/V bytes one device holds per token: its KV heads of every layer."""
    K = model.layout.kv_heads_per_device if isinstance(model, TensorParallelModel) else (
        model.num_kv_heads
    )  # fmt: skip
    return 2 * model.num_layers * K * model.head_dim * itemsize


def collective_ms(tp: int, B: int, D: int, V: int, L: int, dtype, reps: int = 50) -> dict:
    """The collectives of one decode step on ``tp`` devices, each timed in a loop of its own:
    ``2L`` all-reduces of [B, D] f32, one of [B, D] ``dtype`` (the embedding) and one
    all-gather of [B, V] f32."""
    if tp == 1:
        return {"allreduce_us": 0.0, "embed_allreduce_us": 0.0, "allgather_us": 0.0,
                "collective_ms": 0.0}  # fmt: skip
    mesh = make_mesh(tp)
    V_local = math.ceil(V / tp)

    def looped(op, shape, dtype):
        def body(x):
            def step(_, y):
                return op(y)

            return jax.lax.fori_loop(0, reps, step, x)

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("model"), out_specs=P("model"),
                                    check_vma=False))  # fmt: skip
        x = jnp.ones((tp * shape[0], *shape[1:]), dtype)
        return _timing.wall_us(run, x, calls=3, rounds=3) / reps

    def allreduce(y):
        return jax.lax.psum(y, "model") * jnp.asarray(1.0 / tp, y.dtype)

    layer = looped(allreduce, (B, D), jnp.float32)
    embed = looped(allreduce, (B, D), dtype)
    allgather = looped(
        lambda y: jax.lax.all_gather(y, "model", axis=1, tiled=True)[:, :V_local] * 0.5,
        (B, V_local), jnp.float32,
    )  # fmt: skip
    return {"allreduce_us": layer, "embed_allreduce_us": embed, "allgather_us": allgather,
            "collective_ms": (2 * L * layer + embed + allgather) / 1e3}  # fmt: skip


def decode_floor(llm, B: int, ctx: int, k: int, calls: int) -> float:
    """Seconds per decode step of back-to-back decode-loop calls (one sync at the end)."""
    cfg = llm.model.config
    rng = np.random.default_rng(B)
    table = np.zeros((B, llm.width), np.int32)
    for b in range(B):
        llm.alloc.allocate(b, ctx + k)
        t = llm.alloc.block_table(b)
        table[b, : len(t)] = t
    i32 = functools.partial(np.zeros, dtype=np.int32)
    samp = SamplingArrays(temperature=np.zeros(B, np.float32), top_k=i32(B),
                          top_p=np.ones(B, np.float32), seed=i32(B), position=i32(B))  # fmt: skip
    batch = LoopBatch(
        tokens=rng.integers(0, cfg.vocab_size, B).astype(np.int32),
        lens=np.full(B, ctx, np.int32), block_tables=table, active=np.ones(B, bool),
        live=np.ones(B, bool), max_steps=np.full(B, k, np.int32), min_steps=i32(B),
        stop_ids=np.full((B, 4), -1, np.int32), sampling=samp,
    )  # fmt: skip

    def call():
        llm.cache, toks, *_ = llm.runner.decode_loop(llm.cache, batch, num_steps=k, mode="greedy")
        return toks

    for _ in range(2):  # compile, then one warm call
        jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(calls):
        toks = call()
    jax.block_until_ready(toks)
    return (time.perf_counter() - t0) / (calls * k)


def check_tokens(tp_sizes) -> list[dict]:
    """Greedy tokens at each TP size against TP=1 (demo model and test checkpoints)."""
    rows = []
    greedy = jpaged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cases = [("demo", str(jpaged.demo_model_path()),
              [f"{a}+{b}=" for a, b in ((12, 30), (999, 1), (58, 630), (124, 694))])]  # fmt: skip
    for name in CHECKPOINTS:
        with open(ROOT / "tests" / "goldens" / f"{name}.json") as f:
            cases.append((name, str(ROOT / "tests" / "checkpoints" / name),
                          [json.load(f)["prompt_ids"]]))  # fmt: skip
    engine = dict(page_size=8, num_pages=128, max_num_seqs=8, max_num_batched_tokens=64)
    for name, path, prompts in cases:
        for dtype in (jnp.float32, jnp.bfloat16):
            ref = None
            for tp in [1, *(t for t in tp_sizes if t != 1)]:
                try:
                    llm = jpaged.LLM(path, dtype=dtype, tensor_parallel_size=tp, **engine)
                except ValueError as e:  # heads that do not split over tp
                    rows.append({"model": name, "dtype": jnp.dtype(dtype).name, "tp": tp,
                                 "error": str(e)})  # fmt: skip
                    continue
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
                ref = got if tp == 1 else ref
                same = float(np.mean(
                    [a == b for x, y in zip(got, ref, strict=True)
                     for a, b in zip(x, y, strict=True)]))  # fmt: skip
                rows.append({"model": name, "dtype": jnp.dtype(dtype).name, "tp": tp,
                             "same_tokens_as_tp1": same})  # fmt: skip
                print(f"check {name:8} {jnp.dtype(dtype).name:8} TP={tp}: "
                      f"{same:.1%} of greedy tokens equal TP=1's", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "llama-1b", "llama-8b"))
    ap.add_argument("--tp", default="1,2", help="tensor parallel sizes")
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="greedy tokens TP=n vs TP=1 first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n_dev = jax.device_count()
    sizes = [int(t) for t in args.tp.split(",")]
    skipped = [t for t in sizes if t > n_dev]
    sizes = [t for t in sizes if t <= n_dev]
    if skipped:
        print(f"skipping TP={skipped}: {n_dev} device(s)", flush=True)
    spec = serving.model_spec(args.model)
    roof_bytes = (4 << 30) if jax.default_backend() == "gpu" else 1 << 24  # CPU: a smoke run
    roof_tbs, _ = _timing.read_roofline_tbs(roof_bytes)
    out = {"argv": sys.argv if argv is None else argv, "model": args.model,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "devices": n_dev, "roofline_tbs": roof_tbs, "skipped_tp": skipped, "rows": []}  # fmt: skip
    path = pathlib.Path(args.out) if args.out else RESULTS / f"tensor_parallel_{args.model}.json"
    if args.check:
        out["check"] = check_tokens(sizes)
    base = serving.load_model(spec)
    cfg = base.config
    itemsize = jnp.dtype(spec.dtype).itemsize
    C = 16
    for tp in sizes:
        model = base if tp == 1 else shard_model(base, make_mesh(tp))
        weights = device_weight_bytes(model)
        per_token = kv_bytes_per_token(model, itemsize)
        for B in [int(b) for b in args.batch.split(",")]:
            pages = B * (math.ceil((args.ctx + args.k) / C) + 1) + 8
            llm = jpaged.LLM(model, page_size=C, num_pages=pages, max_num_seqs=B,
                             max_model_len=min(args.ctx + 512, cfg.max_position_embeddings),
                             num_decode_steps=args.k,
                             eos_token_id=[], enable_prefix_caching=False)  # fmt: skip
            step_s = decode_floor(llm, B, args.ctx, args.k, args.calls)
            live = B * (args.ctx + (args.k + 1) / 2)  # mean tokens in the cache per step
            bytes_per_step = weights + live * per_token
            coll = collective_ms(tp, B, cfg.hidden_size, cfg.vocab_size, cfg.num_layers,
                                 spec.dtype)  # fmt: skip
            row = {"tp": tp, "batch": B, "ctx": args.ctx, "k": args.k,
                   "step_ms": step_s * 1e3, "device_weight_bytes": weights,
                   "device_kv_bytes_per_token": per_token, "device_bytes_per_step": bytes_per_step,
                   "mbu": bytes_per_step / step_s / (roof_tbs * 1e12), **coll,
                   "collective_share": coll["collective_ms"] / (step_s * 1e3),
                   "predicted_ms": bytes_per_step / (roof_tbs * 1e12) * 1e3 + coll["collective_ms"],
                   "recompiles_after_first_call": llm.stats()["recompiles"]}  # fmt: skip
            out["rows"].append(row)
            del llm
            print(f"TP={tp} B={B:>4}: {row['step_ms']:8.3f} ms/step, MBU per device "
                  f"{row['mbu']:.1%}, collectives {row['collective_ms']:.3f} ms "
                  f"({row['collective_share']:.1%}), predicted {row['predicted_ms']:.3f} ms",
                  flush=True)  # fmt: skip
        del model
    one = {r["batch"]: r["step_ms"] for r in out["rows"] if r["tp"] == 1}
    for r in out["rows"]:
        if r["tp"] > 1 and r["batch"] in one:
            r["speedup_vs_tp1"] = one[r["batch"]] / r["step_ms"]
            print(f"TP={r['tp']} B={r['batch']}: {r['speedup_vs_tp1']:.2f}x TP=1", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
