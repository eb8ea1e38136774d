"""Argument checks and defaults of the Mosaic GPU ragged kernel
(``pallas_kernels/ragged_paged_attention/kernel_gpu.py``), on shapes only: ``unsupported_reason``,
the errors of bad options, the SMEM budget of the default tilings, and the configuration
``make_config`` picks (paired warpgroups, KV splits). The kernel's values are in
``test_ragged_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _ragged_inputs import sds_case

from pallas_kernels import _backend
from pallas_kernels.ragged_paged_attention import kernel_gpu, tuning_gpu


def _shapes(dtype=jnp.bfloat16, N=32, K=8, C=16, H=128):
    sds = jax.ShapeDtypeStruct
    return (
        sds((20, N, H), dtype), sds((K, 10, C, H), dtype), sds((K, 10, C, H), dtype),
        sds((2, 4), jnp.int32), sds((2,), jnp.int32), sds((3,), jnp.int32), sds((), jnp.int32),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dtype": jnp.float32}, "bfloat16"),
        ({"C": 4}, "page_size=4"),
        ({"C": 24}, "page_size=24"),
        ({"H": 96}, "head_dim=96"),
        ({"N": 130, "K": 2}, "group size G=65"),
    ],
)
def test_unsupported_reason_names_the_problem(kw, match):
    reason = kernel_gpu.unsupported_reason(*_shapes(**kw), check_backend=False)
    assert reason is not None and match in reason


@pytest.mark.parametrize("kw", [{}, {"C": 8, "H": 64}, {"C": 256, "H": 256, "N": 8, "K": 8}])
def test_unsupported_reason_accepts_supported(kw):
    assert kernel_gpu.unsupported_reason(*_shapes(**kw), check_backend=False) is None


@pytest.mark.parametrize("capability", [None, (8, 0), (7, 5)])
def test_unsupported_reason_needs_a_hopper_gpu(capability, monkeypatch):
    # No GPU, or one older than Hopper: whatever the machine running the test has.
    monkeypatch.setattr(_backend, "gpu_compute_capability", lambda: capability)
    assert "compute capability" in kernel_gpu.unsupported_reason(*_shapes())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_kv": 32}, "block_kv=32"),
        ({"num_stages": 9}, "num_stages=9"),
        ({"num_wgs": 3}, "num_wgs=3"),
        ({"tile_order": "random"}, "tile_order='random' must be one of"),
        ({"fa3": True, "num_stages": 1}, "num_stages=1 must be >= 2"),
        ({"direct_io": True, "N": 64, "K": 4}, "direct_io=True needs a group size G <= 8"),
        ({"direct_io": True, "H": 256}, r"head_dim <= 128 \(got 256\)"),
        ({"paired": True, "fa3": False}, "paired=True needs the FA3-style body"),
        ({"num_stages": 4, "block_kv": 128, "num_wgs": 2}, "needs .* bytes of SMEM"),
        ({"paired": True, "num_wgs": 1}, "num_wgs=1 must be 2"),
        ({"paired": True, "direct_io": False}, "paired=True needs direct_io"),
        ({"paired": True, "block_kv": 128}, "paired=True needs direct_io"),  # no SMEM room
        ({"kv_splits": 0}, r"kv_splits=0 must be in \[1, 256\]"),
        ({"kv_splits": 2, "direct_io": False}, "kv_splits=2 needs direct_io"),
        ({"dtype": jnp.float32}, "cannot run this call"),
    ],
)
def test_bad_arguments_raise(kw, match):
    kw = dict(kw)
    shape_kw = {k: kw.pop(k) for k in ("dtype", "N", "K", "H") if k in kw}
    args = [jnp.zeros(s.shape, s.dtype) for s in _shapes(**shape_kw)]
    with pytest.raises(ValueError, match=match):
        kernel_gpu.ragged_paged_attention_pallas_gpu(*args, sm_scale=0.1, **kw)


def test_fa3_in_interpret_mode_is_a_clear_error():
    args = [jnp.zeros(s.shape, s.dtype) for s in _shapes()]
    with pytest.raises(ValueError, match="fa3=True cannot run in the Mosaic GPU interpreter"):
        kernel_gpu.ragged_paged_attention_pallas_gpu(*args, sm_scale=0.1, interpret=True, fa3=True)


@pytest.mark.parametrize("fa3", [False, True], ids=["smem", "fa3"])
def test_smem_budget_of_defaults(fa3):
    for H in kernel_gpu.SUPPORTED_HEAD_DIMS:
        T = tuning_gpu.default_block_kv(H, fa3)
        for wgs in (1, 2):
            stages = tuning_gpu.default_num_stages(H, T, wgs, fa3)
            assert stages >= 2
            assert tuning_gpu.smem_bytes(H, T, stages, wgs, fa3) <= tuning_gpu.SMEM_BYTES
            io = tuning_gpu.direct_io_supported(4, H, T, stages, wgs, fa3)
            if io:
                assert tuning_gpu.smem_bytes(H, T, stages, wgs, fa3, True) <= tuning_gpu.SMEM_BYTES
            if fa3:  # in place wherever the FA3 body's defaults leave room, never at 256
                assert io == (H <= 128)
    assert tuning_gpu.default_block_kv(128, True, page_size=16) == 128
    assert tuning_gpu.default_block_kv(128, True, page_size=256) == 128
    assert tuning_gpu.default_block_kv(128, True, page_size=192) == 64
    assert tuning_gpu.default_block_kv(256, True, page_size=16) == 64
    assert tuning_gpu.default_num_wgs(64, 64) == 1  # decode-only batch
    assert tuning_gpu.default_num_wgs(4096, 8) == 2  # prefill


def test_paired_defaults():
    for H, bkv in ((64, 128), (128, 64)):
        assert tuning_gpu.paired_block_kv(H) == bkv
        stages = tuning_gpu.PAIRED_STAGES
        assert tuning_gpu.smem_bytes(H, bkv, stages, 2, True, True, True) <= tuning_gpu.SMEM_BYTES
        assert tuning_gpu.direct_io_supported(4, H, bkv, stages, 2, True, paired=True)
        assert tuning_gpu.default_paired(128, 128, 4, H)  # decode-only batch
        assert tuning_gpu.default_paired(2 * 128, 128, 4, H)  # 2-token decodes
        assert not tuning_gpu.default_paired(2 * 128 + 1, 128, 4, H)  # a chunk beside decodes
        assert not tuning_gpu.default_paired(4096 + 64, 65, 4, H)  # a long prefill
    assert tuning_gpu.paired_block_kv(64, page_size=192) == 64
    assert not tuning_gpu.default_paired(128, 128, 4, 256)  # two rings do not fit
    assert not tuning_gpu.default_paired(128, 128, 16, 128)  # G > 8: no in-place Q / O


def test_make_config_picks_paired_and_splits():
    def cfg(T, B, W, **kw):
        shape = {k: kw.pop(k) for k in ("N", "K", "H", "C") if k in kw}
        return kernel_gpu.make_config(*sds_case(T, B, W, **shape), sm_scale=0.1, **kw)[0]

    c = cfg(8, 8, 2048)  # 8 decodes, 32k-key tables: paired and split
    assert c.fa3 and c.paired and c.num_wgs == 2 and c.block_kv == 64 and c.kv_splits > 1
    c = cfg(128, 128, 256)  # 128 decodes: paired, enough units without splits
    assert c.paired and c.kv_splits == 1
    c = cfg(4096, 8, 512)  # prefill: two warpgroups share each tile, no splits
    assert not c.paired and c.num_wgs == 2 and c.block_kv == 128 and c.kv_splits == 1
    c = cfg(520, 9, 4096)  # a 512-token chunk beside 8 long decodes: split, not paired
    assert not c.paired and c.kv_splits > 1
    w = cfg(8, 8, 2048, sliding_window=256)  # a window bounds the keys a tile reads
    assert 1 <= w.kv_splits < cfg(8, 8, 2048).kv_splits
    # An explicit kv_splits counts in the SMEM check that picks paired (review finding): at
    # H = 64 with 3 stages the LSE tiles would overflow paired SMEM, so it runs unpaired.
    c = cfg(8, 8, 64, N=32, K=8, H=64, num_stages=3, kv_splits=2)
    assert not c.paired and c.kv_splits == 2
    assert cfg(8, 8, 2048, interpret=True).kv_splits == 1  # the interpreter: no default splits


def test_kv_splits_defaults():
    S = tuning_gpu.default_kv_splits
    assert S(8 + 2, 8, 32768, 64) > 1  # B=8 decode at 32k: 80 units
    assert S(1 + 2, 8, 32768, 64) >= 16  # B=1
    assert S(128 + 2, 8, 4096, 64) == 1  # B=128: 1040 units fill the GPU
    assert S(8 + 2, 8, 256, 64) == 1  # short contexts: at least 4 tiles per split
    assert S(4096 // 32 + 2, 8, 8192, 128) == 1  # a 4k prefill
