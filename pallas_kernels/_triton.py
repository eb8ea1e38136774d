"""What the Pallas-Triton kernels (``paged_attention.kernel_triton``,
``ragged_paged_attention.kernel_triton``) share: whether the route exists in this JAX, the
checks both make, and the pieces of their kernel bodies (token rows of a K/V tile, masked tile
loads, one online-softmax step).

The route is Pallas on its Triton backend (``jax.experimental.pallas.triton``): the kernel is
lowered to Triton IR in Python and compiled by the Triton compiler that XLA carries, so it needs
no package beyond jax and jaxlib. JAX deprecated that backend (it warns "The Pallas Triton
backend is deprecated and will be removed in a future JAX version"); ``backend_reason`` says
when it is gone and auto dispatch then uses the XLA path (docs/architecture.md, "Pallas-Triton
kernels").
"""

from __future__ import annotations

import contextlib
import math
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels import _backend, _quant, _triton_quant

LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Triton tensors have power-of-two sizes: the head dim is one axis of every tile.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# f32 tiles are twice the bytes: the largest head dim whose f32 tiles fit the SMEM ring.
MAX_F32_HEAD_DIM = 128


def backend_reason() -> str | None:
    """None when this JAX has Pallas's Triton backend, else why not (it was deprecated in
    2026 and is expected to be removed): ``_backend.triton_route_reason``."""
    return _backend.triton_route_reason()


def triton_module():
    """``jax.experimental.pallas.triton`` (import only after ``backend_reason()`` is None)."""
    from jax.experimental.pallas import triton as plt

    return plt


@contextlib.contextmanager
def quiet_deprecation():
    """Silences the backend's deprecation warning while a kernel is traced and lowered (the
    route's status is documented once, in docs/architecture.md)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\..*triton.*")
        yield


def platform_reason(k_pages=None) -> str | None:
    """None on a GPU backend whose Triton converts ``k_pages``' dtype, else why the compiled
    kernel cannot run (``interpret=True`` runs it anywhere)."""
    if _backend.default_platform() != "gpu":
        return f"needs a GPU backend (this one is {_backend.default_platform()!r}; interpret=True "
        "runs the kernel in Pallas's interpreter)"
    return None if k_pages is None else _triton_quant.generation_reason(k_pages)


# Shared memory a CTA may use on each generation, less room for Triton's own staging of the
# Q and P operands: A100 (sm80) and Hopper/Blackwell have 164-228 KiB an SM, the sm86/sm89
# parts (A10, RTX 30xx/40xx, L4) and consumer Blackwell 100 KiB.
_SMEM_BUDGET_LARGE = 144 * 1024
_SMEM_BUDGET_SMALL = 80 * 1024


def smem_budget() -> int:
    """Bytes of K/V pipeline stages a program may hold on this GPU (the small parts' budget
    without one: cross-lowering and the interpreter)."""
    cc = _backend.gpu_compute_capability()
    large = cc is not None and (cc == (8, 0) or (9, 0) <= cc < (12, 0))
    return _SMEM_BUDGET_LARGE if large else _SMEM_BUDGET_SMALL


def default_num_stages(block_kv: int, head_dim: int, dtype, most: int = 3) -> int:
    """Pipeline depth of the K/V tile loads: as many stages of one K and one V tile as fit
    ``smem_budget()``, 1 to ``most``."""
    stage = 2 * block_kv * head_dim * jnp.dtype(dtype).itemsize
    return max(1, min(most, smem_budget() // stage))


def common_reason(q, k_pages, v_pages, k_scale=None, v_scale=None) -> str | None:
    """Reasons shared by both kernels: this JAX lacks the backend, the dtypes or head dim are
    not covered, quantized pages (``_triton_quant``) without fitting scales. Platform checks
    are the dispatcher's (``pallas_kernels._backend``, ``platform_reason``)."""
    reason = backend_reason()
    if reason is not None:
        return reason
    dt = jnp.dtype(q.dtype)
    if _quant.is_quantized(k_pages.dtype) or k_scale is not None or v_scale is not None:
        reason = _triton_quant.scales_reason(k_pages, v_pages, k_scale, v_scale)
        if reason is not None:
            return reason
    elif jnp.dtype(k_pages.dtype) != dt or jnp.dtype(v_pages.dtype) != dt:
        return f"q, k_pages and v_pages must share one dtype (got {q.dtype}, {k_pages.dtype})"
    if dt not in SUPPORTED_DTYPES:
        return f"dtype {dt} is not one of bfloat16, float16, float32"
    H = q.shape[-1]
    if H not in SUPPORTED_HEAD_DIMS:
        return f"head dim {H} is not a power of two in {SUPPORTED_HEAD_DIMS}"
    if dt == jnp.float32 and H > MAX_F32_HEAD_DIM:
        return f"float32 with head dim {H} > {MAX_F32_HEAD_DIM} does not fit the tiles"
    return None


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << max(0, (int(n) - 1).bit_length()))


def flat_rows(pages, layer):
    """A pool [K, P, C, H] or [L, K, P, C, H] as rows [L * K * P * C, H] (a free reshape) and
    the layer as i32[1] (0 for a 4-D pool)."""
    H = pages.shape[-1]
    layer = 0 if pages.ndim == 4 or layer is None else layer
    return pages.reshape(-1, H), jnp.asarray(layer, jnp.int32).reshape(1)


def token_pages(tab_ref, b, pos_T, *, page_size, width, num_pages):
    """Page ids of the tokens at positions ``pos_T`` of sequence ``b``: block-table column
    ``pos // C``, clamped to the table and the pool. Positions past the sequence are clamped
    too: their rows are never loaded (masked)."""
    col_T = jnp.minimum(pos_T // page_size, width - 1)
    return jnp.clip(tab_ref[b, col_T], 0, num_pages - 1)


def token_rows(page_T, pos_T, *, page_size, head_base):
    """Pool rows of the tokens at positions ``pos_T`` in pages ``page_T`` (``token_pages``):
    the page times C plus the offset in the page; ``head_base``: ``(layer * K + kv_head) *
    P``."""
    return (head_base + page_T) * page_size + pos_T % page_size


def load_rows(ref, rows, cols, valid):
    """Rows ``rows`` [T] of ``ref`` [R, H], columns ``cols`` [H]; rows not ``valid`` read as
    zeros and are never fetched (their pages may hold NaN or lie outside the sequence)."""
    plt = triton_module()
    return plt.load(ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0)


def dot_nt(a, b):
    """a [M, H] @ b [T, H]^T in f32 (IEEE for f32 operands)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """a [M, T] @ b [T, H] in f32 (IEEE for f32 operands)."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def scores(q, k, *, sm_scale, soft_cap, k_factor=None):
    """Base-2 logits of q [M, H] against k [T, H]: ``log2(e) * softcap(sm_scale * q.k)``;
    ``k_factor``: None, or the keys' scales (a scalar or [T]) the dots are multiplied by."""
    s = dot_nt(q, k)
    if k_factor is not None:
        s = s * (k_factor[None, :] if getattr(k_factor, "ndim", 0) else k_factor)
    if soft_cap is None:
        return s * jnp.float32(sm_scale * LOG2E)
    cap = jnp.float32(soft_cap)
    return (cap * LOG2E) * jnp.tanh(s * jnp.float32(sm_scale / soft_cap))


def softmax_step(carry, s, v, visible, v_factor=None):
    """One online-softmax step over a tile: ``carry`` = (m [M], l [M], acc [M, H]) f32 in base
    2; ``s`` [M, T] base-2 logits; ``v`` [T, H] (zeros where invisible); ``visible`` [M, T]
    or None (every key seen); ``v_factor``: None or [T], the values' scales, which multiply
    P's columns before ``P @ V`` (the denominators sum the unscaled P)."""
    m, l, acc = carry
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_ref)
    p = jnp.exp2(s - m_ref[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    pv = p if v_factor is None else p * v_factor[None, :]
    acc = acc * alpha[:, None] + dot_nn(pv.astype(v.dtype), v)
    return m_new, l, acc


def finish(carry):
    """(o [M, H] = acc / l, zeros where l == 0; lse [M] = m + log2(l), -inf where empty)."""
    m, l, acc = carry
    safe = jnp.where(l != 0, l, 1.0)
    o = acc / safe[:, None]
    lse = jnp.where(l != 0, m + jnp.log2(safe), -jnp.inf)
    return o, lse
