"""Quantized pages in the Mosaic TPU decode and ragged kernels, run in the strict TPU interpreter
(``interpret=True``: scratch starts as NaN) against the f64 oracle on the dequantized values:
each granularity in CI (dtypes rotating), the whole dtype x granularity product marked slow."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _quantized_cases import (
    DTYPES,
    GRANULARITIES,
    assert_matches,
    decode_case,
    decode_oracle,
    ragged_case,
    ragged_oracle,
)

from pallas_kernels.paged_attention.kernel_tpu import paged_attention_pallas_tpu
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_pallas_tpu

C = 32  # a multiple of the 8-bit sublane tile (32 rows)
PRODUCT = [(d, g) for d in DTYPES for g in GRANULARITIES]
# CI runs per head (per tensor is the same code with one scale), page and token, the dtypes
# rotating; the rest of the product is slow.
_CI = {("float8_e4m3fn", "head"), ("float8_e5m2", "page"), ("int8", "token")}
SLOW_CASES = {
    f"test_{op}_tpu_interpret[{d}-{g}]" for op in ("decode", "ragged") for d, g in PRODUCT
} - {f"test_{op}_tpu_interpret[{d}-{g}]" for op in ("decode", "ragged") for d, g in _CI}


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_decode_tpu_interpret(dtype, granularity):
    rng = np.random.default_rng(41 + len(dtype) + len(granularity))
    q, kv = decode_case(
        rng, [0, 1, C - 1, C, C + 1, 150], C=C, dtype=dtype, granularity=granularity,
        q_dtype=jnp.float32,
    )  # fmt: skip
    out = paged_attention_pallas_tpu(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125,
        k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=True, pages_per_compute_block=2,
    )  # fmt: skip
    assert_matches(out, decode_oracle(q, kv, sm_scale=0.125), f"{dtype} {granularity}")


@pytest.mark.parametrize("dtype,granularity", PRODUCT)
def test_ragged_tpu_interpret(dtype, granularity):
    rng = np.random.default_rng(43 + len(dtype) + len(granularity))
    case, ks, vs = ragged_case(
        rng, [C - 1, 1, C + 1, 150], [3, 1, C + 1, 20], C=C, dtype=dtype,
        granularity=granularity, q_dtype=jnp.float32,
    )  # fmt: skip
    out = ragged_paged_attention_pallas_tpu(
        *case.args, sm_scale=0.125, k_scale=ks, v_scale=vs, interpret=True
    )
    assert_matches(out, ragged_oracle(case, sm_scale=0.125), f"{dtype} {granularity}")


def test_decode_tpu_interpret_layered_bf16_query():
    # A 5-D pool with per-layer page scales, a bf16 query (the MXU sees bf16), one sequence a
    # program.
    rng = np.random.default_rng(44)
    q, kv = decode_case(
        rng, [C + 1, 150, 0], C=C, dtype="float8_e4m3fn", granularity="page",
        v_granularity="token", num_layers=2,
    )  # fmt: skip
    out = paged_attention_pallas_tpu(
        q, kv.k_pages, kv.v_pages, kv.block_tables, kv.lengths, sm_scale=0.125, layer=1,
        k_scale=kv.k_scale, v_scale=kv.v_scale, interpret=True, seqs_per_program=1,
    )  # fmt: skip
    assert_matches(out, decode_oracle(q, kv, layer=1, sm_scale=0.125))
