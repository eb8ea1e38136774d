"""The Pallas-Triton ragged kernel (``pallas_kernels/ragged_paged_attention/kernel_triton.py``)
against the f64 dense oracle: in Pallas's interpreter on the CPU, lowered for CUDA on the CPU
for the A100, A10, L4 and T4, and compiled on a GPU (``pytest -m gpu``, forced on any NVIDIA GPU).
Mixed batches of decodes, short chunks and prefills over page sizes 1..256, GQA 1/4/8, head
dims 64/128/256, kv lengths 0, 1, C-1, C, C+1, padding rows and dead sequences, permuted
NaN-poisoned pools (``_ragged_inputs``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import assert_rows_close, planted_ragged_case, reference
from _ragged_inputs import dense_ragged_attention, make_ragged_case
from _tolerances import assert_close
from _triton_lowering import lower_for_device

from pallas_kernels.ragged_paged_attention import kernel_triton

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
_CUBE = [
    (C, G, H) for C in (1, 2, 4, 8, 16, 32, 64, 128, 256) for G in (1, 4, 8) for H in (64, 128, 256)
]
# ``make test`` runs the spread in the interpreter (each page size once, each group and head
# dim among them; head dim 64 in test_interpret_options too); the whole cube runs on the GPU
# and in ``make test-all``.
_SPREAD = {
    (1, 4, 128), (2, 4, 64), (4, 1, 128), (8, 4, 128), (16, 4, 128), (16, 8, 256), (32, 8, 128),
    (64, 4, 128), (128, 1, 256), (256, 8, 128),
}  # fmt: skip
SLOW_CASES = {
    f"test_interpret_mixed_batch[{C}-{G}-{H}]" for (C, G, H) in _CUBE if (C, G, H) not in _SPREAD
}


def _run(case, dtype, *, interpret=True, sm_scale=None, layer=None, **opts):
    H = case.args[0].shape[-1]
    scale = 1.0 / math.sqrt(H) if sm_scale is None else sm_scale
    attn = {k: opts.pop(k) for k in ("causal", "logits_soft_cap", "sliding_window") if k in opts}
    out = kernel_triton.ragged_paged_attention_pallas_triton(
        *[jnp.asarray(a) for a in case.args], sm_scale=scale, layer=layer, interpret=interpret,
        **attn, **opts,
    )  # fmt: skip
    assert out.shape == case.args[0].shape and out.dtype == dtype
    lyr = None if layer is None else int(layer)
    ref = dense_ragged_attention(case, sm_scale=scale, layer=lyr, **attn)
    assert_close(out, ref, dtype, err_msg=f"{attn} {opts}")
    out = np.asarray(out, np.float32)
    assert np.all(out[sum(case.q_lens) :] == 0.0), "padding rows must be zeros"
    return out


def _mixed(rng, C, G, H, dtype=BF16, long=150, **kw):
    kv_lens = (0, 1, max(C - 1, 1), C, C + 1, 2 * C + 5, long)
    q_lens = (0, 1, 1, C, 1, 7, long // 2)  # decodes, a page-long chunk, a prefill chunk
    return make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=2 * G, num_kv_heads=2, head_dim=H, page_size=C,
        dtype=dtype, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("C,G,H", _CUBE)
def test_interpret_mixed_batch(C, G, H):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    _run(_mixed(rng, C, G, H), BF16)


@pytest.mark.parametrize(
    "C,G,H,dtype,extra",
    [
        (16, 4, 64, F16, dict(num_splits=3)),
        (3, 1, 32, F32, dict(num_splits=2, sliding_window=9)),  # odd page size, f32
        (8, 6, 64, BF16, dict(sliding_window=9, logits_soft_cap=3.0)),  # G=6: rows padded
        (16, 8, 32, BF16, dict(causal=False, block_m=16, block_kv=16)),
        (4, 4, 32, F16, dict(num_layers=2, layer=jnp.int32(1), block_m=32, num_splits=2)),
        (16, 4, 64, BF16, dict(sm_scale=-0.2, block_kv=16, num_splits=7)),  # empty splits
        (32, 2, 64, BF16, dict(sliding_window=1, block_m=16)),
        (16, 128, 16, BF16, dict(block_kv=32)),  # G=128: one token a tile
    ],
    ids=[
        "f16-split3",
        "C3-f32-window",
        "G6-cap-window",
        "noncausal",
        "layer-split2",
        "negscale-split7",
        "window1",
        "G128",
    ],
)
def test_interpret_options(C, G, H, dtype, extra):
    rng = np.random.default_rng(C + G + H)
    extra = dict(extra)
    L = extra.pop("num_layers", None)
    _run(_mixed(rng, C, G, H, dtype, num_layers=L), dtype, **extra)


def test_interpret_prefill_many_tiles_and_planted_keys():
    """A 300-token prefill beside decodes, on planted keys: a skipped key tile, an unmasked
    diagonal or a mis-scaled logit moves some row by several tolerances."""
    rng = np.random.default_rng(9)
    case = planted_ragged_case(
        rng, [300, 40, 1, 257], [300, 1, 1, 60], num_q_heads=8, num_kv_heads=2, head_dim=64,
        page_size=16,
    )  # fmt: skip
    for knobs in (dict(), dict(num_splits=3, block_m=32)):
        out = kernel_triton.ragged_paged_attention_pallas_triton(
            *[jnp.asarray(a) for a in case.args], sm_scale=1 / 8.0, interpret=True, **knobs
        )
        assert_rows_close(out, reference(case), BF16, err_msg=str(knobs))


def test_defaults():
    cfg = kernel_triton.make_config(
        jax.ShapeDtypeStruct((4096, 32, 128), BF16), jax.ShapeDtypeStruct((8, 300, 16, 128), BF16),
        jax.ShapeDtypeStruct((1, 256), jnp.int32), sm_scale=0.1,
    )  # fmt: skip
    assert (cfg.block_m, cfg.block_q, cfg.block_kv) == (128, 32, 64)
    dec = kernel_triton.make_config(
        jax.ShapeDtypeStruct((64, 32, 128), BF16), jax.ShapeDtypeStruct((8, 300, 16, 128), BF16),
        jax.ShapeDtypeStruct((64, 256), jnp.int32), sm_scale=0.1,
    )  # fmt: skip
    assert (dec.block_m, dec.block_q) == (16, 4)  # decode-like: the group's rows
    with pytest.raises(ValueError, match="block_m=8 must be an int in"):
        kernel_triton.make_config(
            jax.ShapeDtypeStruct((64, 32, 128), BF16),
            jax.ShapeDtypeStruct((8, 300, 16, 128), BF16),
            jax.ShapeDtypeStruct((64, 256), jnp.int32), sm_scale=0.1, block_m=8,
        )  # fmt: skip


def _ragged_shapes(T=40, B=5, N=8, K=2, H=128, C=16, W=8, dtype=BF16, L=None):
    pool = (K, 60, C, H) if L is None else (L, K, 60, C, H)
    return (
        jax.ShapeDtypeStruct((T, N, H), dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct(pool, dtype),
        jax.ShapeDtypeStruct((B, W), jnp.int32),
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((B + 1,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


@pytest.mark.parametrize("device_kind", ["NVIDIA A100", "NVIDIA A10", "NVIDIA L4", "Tesla T4"])
@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(shape=dict(T=8, B=8), num_splits=4, logits_soft_cap=30.0, sliding_window=100),
        dict(shape=dict(H=256, C=1, dtype=F16, L=2), causal=False),
        dict(shape=dict(H=64, C=3, dtype=F32)),
    ],
    ids=str,
)
def test_lowers_for_cuda(device_kind, variant):
    v = dict(variant)
    shape = v.pop("shape", {})
    L = shape.get("L")

    def f(q, kp, vp, bt, kl, cu, ns):
        cfg = kernel_triton.make_config(q, kp, bt, sm_scale=0.1, **v)
        layer = None if L is None else 1
        return kernel_triton._ragged(cfg, q, kp, vp, bt, kl, cu, ns, layer)

    text = lower_for_device(device_kind, f, _ragged_shapes(**shape))
    assert "__gpu$xla.gpu.triton" in text and "ragged_paged_triton" in text


# --- compiled on a GPU --------------------------------------------------------------------


# On the GPU: every page size, group and head dim, each meeting each other axis's values
# (a third of the cube, a compile each), bf16 and f16 alternating.
_GPU_CASES = [
    (C, G, H, "bfloat16" if (C + G) % 2 else "float16")
    for (C, G, H) in _CUBE
    if (C + G + H) % 3 == 0 or (C, H) == (16, 128)
]


@pytest.mark.gpu
@pytest.mark.parametrize("C,G,H,dtype", _GPU_CASES)
def test_gpu_mixed_batch(C, G, H, dtype):
    rng = np.random.default_rng(C * 1000 + G * 10 + H)
    _run(_mixed(rng, C, G, H, jnp.dtype(dtype), long=1000), jnp.dtype(dtype), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "extra",
    [
        dict(),
        dict(num_splits=4),
        dict(sliding_window=300, logits_soft_cap=30.0),
        dict(causal=False, num_splits=2),
        dict(num_layers=3, layer=jnp.int32(2)),
        dict(dtype=F32, C=3),
    ],
    ids=str,
)
def test_gpu_options(extra):
    rng = np.random.default_rng(17)
    extra = dict(extra)
    dtype, C, L = extra.pop("dtype", BF16), extra.pop("C", 16), extra.pop("num_layers", None)
    kv_lens = (1536, 513, 64, 1, 3000, 0)
    q_lens = (1536, 13, 64, 1, 1, 0)
    case = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=C,
        dtype=dtype, num_layers=L,
    )  # fmt: skip
    _run(case, dtype, interpret=False, **extra)


@pytest.mark.gpu
def test_gpu_decode_batch_long_context_and_planted():
    rng = np.random.default_rng(23)
    case = make_ragged_case(
        rng, (32768, 20001, 1), (1, 1, 1), num_q_heads=32, num_kv_heads=8, head_dim=128,
        page_size=16, dtype=BF16,
    )  # fmt: skip
    _run(case, BF16, interpret=False)
    planted = planted_ragged_case(
        rng, [4096, 2000, 1, 777], [4096, 1, 1, 100], num_q_heads=32, num_kv_heads=8,
        head_dim=128, page_size=16,
    )  # fmt: skip
    for knobs in (dict(), dict(num_splits=4)):
        out = kernel_triton.ragged_paged_attention_pallas_triton(
            *[jnp.asarray(a) for a in planted.args], sm_scale=1 / math.sqrt(128), **knobs
        )
        assert_rows_close(out, reference(planted), BF16, err_msg=str(knobs))
