"""Tensor and data parallelism on 8 CPU devices (``--xla_force_host_platform_device_count=8``).

Not collected by the suite itself (the rest of the suite runs on one device):
``tests/parallel/test_parallel_mesh.py`` runs this file in a subprocess with 8 devices.
Run it alone with
``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/parallel/mesh_cases.py``.

- the engine at TP = 1, 2, 4, 8 and on a 2 x 2 ("data", "model") mesh gives transformers'
  greedy and beam-search tokens on every golden checkpoint (N = 4 query heads, K = 2 or 1 KV
  heads: TP = 4 and 8 hold copies of the KV heads, TP = 8 of the query heads too);
- each device's part of the pool holds the KV head its query heads read;
- the attention ops run under ``shard_map`` on one device's heads, every implementation;
- checkpoints load each device's rows straight from the files;
- no compile after warm-up, preemption (recompute, swap) and prefix caching under TP, and
  the data-parallel front (routing, prefix affinity, abort, combined stats);
- an fp8 pool and its per-token scales split on the KV-head axis, swapped under tensor
  parallelism, give the one-device fp8 engine's tokens.
"""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _paged_inputs import make_paged_kv
from _ragged_inputs import make_ragged_case
from _tolerances import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpaged
import jpaged.parallel
from jpaged import models
from jpaged.models import _loader
from jpaged.parallel import TensorParallelModel, make_mesh
from pallas_kernels.paged_attention import dispatch as paged_dispatch
from pallas_kernels.ragged_paged_attention import dispatch as ragged_dispatch

if jax.device_count() < 8:
    pytest.skip(
        "needs 8 devices: run through tests/parallel/test_parallel_mesh.py (or set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8)",
        allow_module_level=True,
    )

# 8 MiB of host slots (the default 1 GiB: 262144 slots, which debug=True's invariant check
# walks after every step; tests/_engine_helpers.py's SWAP_SPACE)
ENGINE = dict(page_size=8, num_pages=64, max_num_seqs=8, max_model_len=64,
              max_num_batched_tokens=32, debug=True, swap_space=8 << 20)  # fmt: skip
NAMES = ("llama2", "llama3", "mistral", "qwen2")
MESHES = {"tp1": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "tp8": (8, 1), "data2xmodel2": (2, 2)}
# CI checks transformers' greedy and beam tokens at TP=2; TP=8's copies of the KV and query
# heads give the one-device tokens in test_kv_heads_fewer_than_devices_are_copied_to_each_
# reader[mistral-8], the 2 x 2 mesh's replicas in test_data_parallel_routes_requests_to_
# replicas (TP=4, TP=8 and the 2 x 2 mesh against transformers in `make test-all`).
DEFAULT_GOLDEN = {("llama2", "tp2")}
SLOW_CASES = [
    f"test_greedy_and_beam_match_transformers[{name}-{mesh}]"
    for name in NAMES
    for mesh in MESHES
    if (name, mesh) not in DEFAULT_GOLDEN
] + [
    "test_attention_runs_per_device_on_local_heads[ragged-pallas_gpu]",
    "test_attention_runs_per_device_on_local_heads[ragged-pallas_tpu]",
    "test_bf16_split_model_gives_the_one_device_tokens[llama2-4]",
    "test_bf16_split_model_gives_the_one_device_tokens[qwen2-8]",
    "test_pool_keeps_its_sharding_through_page_programs",
    "test_a_quantized_pool_splits_its_scales_with_its_kv_heads",
    # K=2 over 4 devices (mistral-8 checks each device's copy of the pool's KV head, K=1 over
    # 8; qwen2's K=2 over 4 loads and runs in test_checkpoint_loads_each_devices_rows_one_layer_
    # at_a_time)
    "test_kv_heads_fewer_than_devices_are_copied_to_each_reader[llama3-4]",
    # Joins and the grown carry under TP=2 (CI: warm-up's join program and no compile after it
    # under TP=2, test_no_compile_after_warmup_under_tensor_parallelism; joins and growth on
    # one device, tests/engine/test_chain_join.py); swap preemption under TP=2 (CI: recompute
    # here; swap with the model split over two processes' four devices,
    # test_parallel_mesh.py's test_two_processes_run_one_split_model_in_lockstep)
    "test_rows_join_and_the_carry_grows_without_compiles_under_tensor_parallelism",
    "test_preemption_under_tensor_parallelism[swap]",
    # Two page groups through swap preemption under TP=2 (CI: [recompute]; swap with two groups
    # on one device: tests/engine/test_engine_page_groups.py)
    "test_page_groups_under_tensor_parallelism[swap]",
]


def _golden(name: str) -> dict:
    with open(f"tests/goldens/{name}.json") as f:
        return json.load(f)


def _poison(llm) -> None:
    """Fills every pool (each replica's) with NaN, keeping its sharding."""
    for engine in llm.replicas or [llm]:
        k = engine.cache.k_pages
        nan = jax.device_put(np.full(k.shape, np.nan, k.dtype), k.sharding)
        engine.cache = jpaged.PagedKVCache(k_pages=nan, v_pages=jnp.copy(nan))


def _llm(name: str, mesh: str, **kw):
    tp, dp = MESHES[mesh]
    llm = jpaged.LLM(f"tests/checkpoints/{name}", mesh=make_mesh(tp, dp), **{**ENGINE, **kw})
    _poison(llm)
    return llm


@functools.cache
def _one_device_model(name: str):
    return models.from_pretrained(f"tests/checkpoints/{name}")


GREEDY = jpaged.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", NAMES)
def test_greedy_and_beam_match_transformers(name, mesh):
    g = _golden(name)
    beam = g["beam_search"]
    llm = _llm(name, mesh, eos_token_id=beam["eos_token_id"])
    tp, dp = MESHES[mesh]
    engines = llm.replicas or [llm]
    assert len(engines) == dp
    for e in engines:  # each device holds its own K_local heads of the pool
        K_local = max(e.model.config.num_kv_heads // tp, 1)
        shards = e.cache.k_pages.addressable_shards
        assert len(shards) == tp and {s.data.shape[1] for s in shards} == {K_local}
    outs = llm.generate([g["prompt_ids"]] * 3, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [g["greedy"]["tokens"]] * 3
    params = jpaged.BeamSearchParams(
        beam_width=beam["num_beams"], max_tokens=beam["max_new_tokens"],
        length_penalty=beam["length_penalty"], early_stopping=beam["early_stopping"],
    )  # fmt: skip
    out = llm.beam_search([beam["prompt_ids"]], params)[0]
    assert [c.token_ids for c in out.outputs] == beam["sequences"]
    np.testing.assert_allclose(
        [c.score for c in out.outputs], beam["sequence_scores"], atol=1e-4, rtol=1e-4
    )
    assert llm.stats()["pages_used"] == 0


@pytest.mark.parametrize("name,tp", [("llama3", 4), ("mistral", 8)])
def test_kv_heads_fewer_than_devices_are_copied_to_each_reader(name, tp):
    # llama3: K=2 over 4 devices; mistral: K=1 over 8 (and N=4 query heads: each on 2).
    g = _golden(name)
    prompts = [g["prompt_ids"], g["prompt_ids"][:7]]
    kw = dict(ENGINE, enable_prefix_caching=False)
    one = jpaged.LLM(_one_device_model(name), **kw)
    split = jpaged.LLM(_one_device_model(name), tensor_parallel_size=tp, **kw)  # a model object
    a = one.generate(prompts, GREEDY)
    b = split.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    c = split.model.config
    assert split.cache.k_pages.shape[1] == tp  # one pool head per device
    kv_head = split.model.layout.indices("kv")[:, 0]
    group = c.num_heads // c.num_kv_heads
    assert kv_head.tolist() == [split.model.layout.indices("q")[d, 0] // group for d in range(tp)]
    for pages in ("k_pages", "v_pages"):
        whole = np.asarray(getattr(one.cache, pages))  # [L, K, P, C, H]
        for shard in getattr(split.cache, pages).addressable_shards:
            d = shard.index[1].start
            assert_close(shard.data[:, 0], whole[:, kv_head[d]], jnp.float32, scale=2.0)


def _attention_case(op: str, dtype):
    """(public op, dispatch table, arguments, their PartitionSpecs, extra kwargs) of a random
    case: K=4 KV heads, G=2, a 2-layer NaN-poisoned pool with permuted pages."""
    K, G, H, C, L = 4, 2, 64, 16, 2
    rng = np.random.default_rng(7)
    heads = P(None, "model")
    if op == "decode":
        kv = make_paged_kv(rng, [0, 1, C - 1, C, C + 1, 70], num_kv_heads=K, head_dim=H,
                           page_size=C, dtype=dtype, num_layers=L)  # fmt: skip
        q = jnp.asarray(rng.standard_normal((6, K * G, H)), dtype)
        args = (q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths)
        return (
            jpaged.paged_attention,
            paged_dispatch.IMPLEMENTATIONS,
            args,
            (heads,) * 3 + (P(),) * 2,
            {},
        )
    case = make_ragged_case(rng, (5, 17, 33), (5, 2, 1), num_q_heads=K * G, num_kv_heads=K,
                            head_dim=H, page_size=C, dtype=dtype, num_layers=L)  # fmt: skip
    table = ragged_dispatch.IMPLEMENTATIONS
    return (
        jpaged.ragged_paged_attention,
        table,
        case.args,
        (heads,) * 3 + (P(),) * 4,
        {"causal": True},
    )


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_attention_runs_per_device_on_local_heads(op, impl):
    # Under shard_map over the pool's KV-head axis each device's call sees its own heads:
    # [B, N/tp, H] queries and [L, K/tp, P, C, H] pages. JAX's Mosaic GPU interpreter keeps
    # one device's shared memory, so the GPU kernel is cross-lowered for CUDA under shard_map
    # (local shapes in its custom call) and interpreted on each device's block in turn.
    tp = 2
    dtype = jnp.bfloat16 if impl == "pallas_gpu" else jnp.float32
    fn, table, args, specs, extra = _attention_case(op, dtype)
    layer = jnp.int32(1)
    kwargs = dict(sm_scale=0.125, logits_soft_cap=None, sliding_window=None, layer=layer, **extra)
    seen = []

    def local(*a):
        seen.append((a[0].shape[1], a[1].shape[1]))
        if impl == "pallas_gpu":  # the kernel itself: auto checks need a Hopper device
            return table[impl](*a, **kwargs)
        return fn(*a, sm_scale=0.125, layer=layer, implementation=impl,
                  interpret=None if impl == "xla" else True)  # fmt: skip

    mesh = make_mesh(tp)
    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, "model"),
                                    check_vma=False))  # fmt: skip
    whole = np.asarray(fn(*args, sm_scale=0.125, layer=layer, implementation="xla"), np.float32)
    N, K = args[0].shape[1], args[1].shape[1]
    if impl != "pallas_gpu":
        out = sharded(*args)
        assert seen == [(N // tp, K // tp)]
        assert_close(out, whole, dtype)
        return
    lowered = sharded.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert seen == [(N // tp, K // tp)] and "mosaic_gpu" in lowered
    L, _, Pn, C, H = args[1].shape
    assert f"tensor<{L}x{K // tp}x{Pn}x{C}x{H}xbf16>" in lowered
    for d in range(tp):  # what device d runs: its query heads over its KV heads
        qs, ks = slice(d * N // tp, (d + 1) * N // tp), slice(d * K // tp, (d + 1) * K // tp)
        block = (args[0][:, qs], args[1][:, ks], args[2][:, ks], *args[3:])
        out = fn(*block, sm_scale=0.125, layer=layer, implementation=impl, interpret=True)
        assert_close(out, whole[:, qs], dtype)


def test_checkpoint_loads_each_devices_rows_one_layer_at_a_time(monkeypatch):
    reads = []
    make_reader = _loader._sharded_reader

    def recording(*a, **kw):
        read = make_reader(*a, **kw)

        def rec(name, layer, axis, lo, hi):
            x = read(name, layer, axis, lo, hi)
            reads.append((name, layer, axis, hi - lo, x.nbytes))
            return x

        return rec

    monkeypatch.setattr(_loader, "_sharded_reader", recording)
    tp = 4
    split = models.from_pretrained("tests/checkpoints/qwen2", mesh=make_mesh(tp))
    one = _one_device_model("qwen2")
    c = one.config
    largest_layer_tensor = (
        max(
            math.prod(s[1:]) if n.startswith("layers.") else math.prod(s)
            for n, s in models.param_shapes(c).items()
        )
        * 4
    )
    assert max(nbytes for *_, nbytes in reads) <= largest_layer_tensor
    per_device = {"wq_LDNH": 1, "wk_LDKH": 1, "wv_LDKH": 1, "wo_LNHD": 1,
                  "w_gate_LDF": c.intermediate_size // tp, "w_down_LFD": c.intermediate_size // tp,
                  "embed_VD": c.vocab_size // tp}  # fmt: skip
    for name, layer, _, rows, _ in reads:
        if name in per_device:
            assert rows == per_device[name], (name, layer, rows)
    assert {r[1] for r in reads} == {None, *range(c.num_layers)}
    assert isinstance(split, TensorParallelModel)
    shapes = {s.data.shape for s in split.shard.layers.wqkv_LDX[...].addressable_shards}
    assert shapes == {(c.num_layers, c.hidden_size, 3 * c.head_dim)}  # 1 q, 1 k, 1 v head
    tokens = jnp.asarray([_golden("qwen2")["prompt_ids"]], jnp.int32)
    forward = jax.jit(lambda m, t: m.forward_dense(t))  # one program each, not op by op
    assert_close(forward(split, tokens), forward(one, tokens), jnp.float32, scale=2.0)


@pytest.mark.parametrize("name,tp", [("mistral", 2), ("llama2", 4), ("qwen2", 8)])
def test_bf16_split_model_gives_the_one_device_tokens(name, tp):
    # The partial sums are all-reduced in f32 and rounded once, as the one-device GEMM does:
    # with bf16 partials these greedy runs diverged from the one-device run (mistral at TP=2
    # after its first few tokens).
    g = _golden(name)
    prompts = [g["prompt_ids"], g["prompt_ids"][:9]]
    path = f"tests/checkpoints/{name}"
    one = jpaged.LLM(path, dtype=jnp.bfloat16, **ENGINE).generate(prompts, GREEDY)
    split = jpaged.LLM(path, dtype=jnp.bfloat16, tensor_parallel_size=tp, **ENGINE)
    assert split.cache.dtype == jnp.bfloat16
    got = split.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in one]


def test_padded_mlp_and_vocabulary_blocks_add_nothing():
    # F=20 and V=37 do not split evenly over 8 (the last F block is all padding), every bias
    # on (o and down biases added once, after the all-reduce), tied embeddings.
    c = models.tiny(num_heads=4, num_kv_heads=2, intermediate_size=20, vocab_size=37,
                    qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=True)  # fmt: skip
    from flax import nnx

    one = models.LlamaForCausalLM(c, rngs=nnx.Rngs(4))
    split = jpaged.parallel.shard_model(one, make_mesh(8))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (2, 11)), jnp.int32)
    forward = jax.jit(lambda m, t: m.forward_dense(t))  # one program each, not op by op
    got = forward(split, tokens)
    assert got.shape == (2, 11, 37)
    assert_close(got, forward(one, tokens), jnp.float32)


def test_no_compile_after_warmup_under_tensor_parallelism():
    llm = _llm("llama2", "tp2")
    # As on one device: decode, the loop in 3 sampling modes, the ragged step of the one token
    # bucket (the budget, 32), the join of rows into a running chain, and the page programs
    # (beam search's top-k step compiles on first use).
    report = llm.warmup()
    assert [p.name for p in report.programs] == [
        "decode B=8", "loop B=8 greedy", "loop B=8 random", "loop B=8 truncate",
        "ragged T=32 B=8", "join B=8 R=8",
    ]  # fmt: skip
    assert report.num_page_programs == 3
    warm = llm.stats()["recompiles"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (3, 20, 9, 1, 15, 30)]
    llm.generate(prompts, GREEDY)
    llm.generate(prompts[:3], jpaged.SamplingParams(max_tokens=9, temperature=0.8, top_k=5,
                                                      n=2, seed=1, stop_token_ids=[5]))  # fmt: skip
    llm.generate(prompts[:2], [jpaged.SamplingParams(max_tokens=9, seed=1, top_p=0.9),
                               jpaged.SamplingParams(max_tokens=9, temperature=0.0)])  # fmt: skip
    assert llm.stats()["recompiles"] == warm


def test_rows_join_and_the_carry_grows_without_compiles_under_tensor_parallelism():
    # Two row buckets (16, 20): a chain of 16 rows grows to 20 for rows that join it; the
    # grown carry and a ragged step's tokens meet the join programs warm-up compiled.
    kw = dict(num_pages=256, max_num_seqs=20)
    llm = _llm("llama2", "tp2", **kw)
    names = [p.name for p in llm.warmup().programs]
    assert "grow B=16->20" in names and "join B=20 R=16" in names and "join B=20 R=20" in names
    warm = llm.stats()["recompiles"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, size=3 + i % 7).tolist() for i in range(20)]
    params = jpaged.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts[:16]]
    while llm.chain.state is None:
        llm.step()
    ids += [llm.add_request(p, params) for p in prompts[16:]]
    while llm.has_unfinished_requests():
        llm.step()
    s = llm.stats()
    assert s["recompiles"] == warm
    assert s["chain_grows"] > 0 and s["chain_joins"] >= 4
    ref = _llm("llama2", "tp2", join_running=False, **kw).generate(prompts, params)
    got = [llm.get_output(r).outputs[0].token_ids for r in ids]
    assert got == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_tensor_parallelism(mode):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (11, 14, 9)]
    params = jpaged.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = _llm("llama2", "tp2").generate(prompts, params)
    # 10 pages of 8 tokens: three sequences growing to ~50 tokens cannot all fit.
    llm = _llm("llama2", "tp2", num_pages=10, watermark=0.0, preemption_mode=mode)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    s = llm.stats()
    assert s[f"preemptions_{mode}"] >= 1 and s["pages_used"] == 0
    if mode == "swap":
        assert s["swapped_in_bytes"] == s["swapped_out_bytes"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_page_groups_under_tensor_parallelism(mode):
    """Gemma 2's two page groups (`jpaged.kv.page_groups`) on a split pool: the layer axis
    holds L / 2 slices, the local group releases pages outside the window, and greedy equals
    transformers, through preemption in small groups too."""
    g = _golden("gemma2")
    kw = dict(page_size=4, max_model_len=64)
    # Groups of one sequence's 16 pages each for five sequences: preempted, the same tokens.
    prompts = [g["prompt_ids"][:n] for n in (19, 9, 4, 12, 15)]
    small = _llm("gemma2", "tp2", **kw, num_pages=16, num_local_pages=16, watermark=0.0,
                 preemption_mode=mode)  # fmt: skip
    assert isinstance(small.alloc, jpaged.PageGroups) and small.cache.k_pages.shape[0] == 2
    outs = small.generate(prompts, GREEDY)
    ref = _llm("gemma2", "tp2", **kw, num_local_pages=0).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert outs[0].outputs[0].token_ids == g["greedy"]["tokens"]
    s = small.stats()
    assert s[f"preemptions_{mode}"] >= 1 and s["pages_used"] == 0
    assert s["pages_released_by_window"] > 0


def test_prefix_cache_under_tensor_parallelism():
    g = _golden("llama2")
    llm = _llm("llama2", "tp2")
    miss = llm.generate([g["prompt_ids"]], GREEDY)[0]
    hit = llm.generate([g["prompt_ids"]], GREEDY)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens == 16  # 2 pages of 8 of 19
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids == g["greedy"]["tokens"]


def test_data_parallel_routes_requests_to_replicas():
    g = _golden("llama2")
    llm = _llm("llama2", "data2xmodel2")
    assert len(llm.replicas) == 2 and llm.alloc is None
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (12, 9, 20, 5)]
    ref = jpaged.LLM(_one_device_model("llama2"), **ENGINE).generate(prompts, GREEDY)
    report = llm.warmup()  # the replicas' programs in one report
    assert [p.name for p in report.programs][:2] == ["r0 decode B=8", "r0 loop B=8 greedy"]
    assert len(report.programs) == 12 and report.num_page_programs == 6  # 6 per replica
    warm = llm.stats()["recompiles"]
    assert {d for r in llm.replicas for d in r.model.mesh.devices.flat} == set(
        make_mesh(2, 2).devices.flat
    )
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    per_replica = [s["tokens_generated"] for s in llm.stats()["replicas"]]
    assert all(n > 0 for n in per_replica) and llm.stats()["tokens_generated"] == sum(per_replica)
    # The same prompt goes to the replica that cached it.
    owner = next(r for r in llm.replicas if r.alloc.match_prefix(prompts[2])[0])
    again = llm.generate([prompts[2]], GREEDY)[0]
    assert (
        again.num_cached_tokens == 16 and again.outputs[0].token_ids == ref[2].outputs[0].token_ids
    )
    assert again.request_id in owner._book
    rid = llm.add_request(g["prompt_ids"], GREEDY)
    llm.step()
    llm.abort(rid)
    assert llm.get_output(rid).outputs[0].finish_reason == "abort"
    assert not llm.has_unfinished_requests() and llm.stats()["pages_used"] == 0
    assert llm.stats()["recompiles"] == warm
    with pytest.raises(AttributeError, match="replicas"):
        llm.cache  # noqa: B018


def test_pool_keeps_its_sharding_through_page_programs():
    llm = _llm("llama2", "tp4", swap_space=1 << 20)
    sharding = llm.cache.k_pages.sharding
    assert sharding.spec == P(None, "model") and isinstance(sharding, NamedSharding)
    llm.warmup()  # copy-on-write and swap programs on the split pool
    assert llm.cache.k_pages.sharding == sharding and llm.cache.v_pages.sharding == sharding


def test_a_quantized_pool_splits_its_scales_with_its_kv_heads():
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (11, 14, 9)]
    params = jpaged.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    one = jpaged.LLM(_one_device_model("llama2"), cache_dtype="fp8", **ENGINE)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    # 10 pages of 8 tokens: three sequences growing to ~50 tokens cannot all fit.
    llm = jpaged.LLM("tests/checkpoints/llama2", mesh=make_mesh(2), cache_dtype="fp8",
                     **{**ENGINE, "num_pages": 10, "watermark": 0.0, "preemption_mode": "swap"})  # fmt: skip
    c = llm.cache
    assert c.k_pages.dtype == jnp.float8_e4m3fn and c.k_scale.shape == c.k_pages.shape[:-1]
    for x in (c.k_pages, c.v_pages, c.k_scale, c.v_scale):
        assert x.sharding.spec == P(None, "model")
        assert {s.data.shape[1] for s in x.addressable_shards} == {1}  # one KV head each
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    s = llm.stats()
    assert s["preemptions_swap"] >= 1 and s["swapped_in_bytes"] == s["swapped_out_bytes"] > 0
    assert llm.cache.k_scale.sharding.spec == P(None, "model")
