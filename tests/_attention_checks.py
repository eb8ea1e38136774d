"""Attention inputs where every 64-token tile matters, their f64 oracle, and a per-row check.

With i.i.d. normal q, K and V a long row's output entries are about 1/sqrt(keys) in size, under
the bf16 atol of ``_tolerances.py`` (2e-2): a kernel that skips one 64-key tile of 4096, or
scales every logit by 1.01, passes ``assert_close``. Measured per row (``row_errors``) the
dropped tile shows, but the 1% logit scale moves such a row by only 1-2%, near bf16 noise.
The inputs built here make each of these bugs move some row by 6% to over 100% of its largest
entry, while a correct bf16 kernel stays under 0.6% (XLA and both interpreters, measured).

The planted inputs, per sequence b and KV head k (one unit direction ``u[b, k]`` in R^H):
  * the keys are split into blocks of ``g = gcd(C, 64)`` tokens (each block lies in one page
    and one 64-token tile); each block holds one *planted* key at a random position, whose
    component along ``u`` is ``A + U(-0.5, 0.5)`` (distinct logits), the other keys are
    standard normal;
  * every query row of the sequence (each query head of the group) is
    ``sqrt(H) * (beta * u + 0.25 * xi)`` with ``beta`` in [0.95, 1.05] and ``xi`` a unit vector
    orthogonal to ``u``: at the default scale 1/sqrt(H) a background logit is about N(0, 1)
    and a planted one about ``A``, with ``A = ln(g - 1) + 0.46`` chosen so the planted keys
    hold about half the softmax mass of a long row;
  * a planted value is one-hot: ``+-M_b`` in a code coordinate (the codes cycle through a
    random permutation of the other H - 1 coordinates) plus ``+M0`` in a balance coordinate
    ``c*``; background values are standard normal with ``-M0`` at ``c*``.

What each bug does to a long row, relative to the row's largest |output| (about 1.5):
  * a tile (or page) skipped removes its planted keys' ``+-M_b`` from their code coordinates:
    ``M_b = sqrt(n_b * min(n_b, H - 1))`` for ``n_b`` blocks keeps a code coordinate near
    0.5 and moves it by ``0.5 / sqrt(n_b / (H - 1))`` (6-12% at 32k tokens, H = 64);
  * logits scaled by 1 + e shift mass between the planted keys and the background by
    ``e * f (1 - f) (A - 1)`` (f about 0.5), which the balance coordinate (about
    ``M0 (2f - 1)``, near 0) turns into ``2 M0`` times that: 12-20% at e = 0.01.
A correct kernel's error is bf16 rounding of the output (2^-9 of the largest entry) plus the
rounding of P (averaged over the keys): about 0.2-0.3% of the row.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from _paged_inputs import dense_attention, make_paged_kv
from _ragged_inputs import RaggedCase, dense_ragged_attention, make_ragged_case

# Tokens of one kernel K/V tile: the planted blocks never straddle one.
TILE = 64
# Balance coordinate magnitude, and the spread of q's direction off the planted one.
_M0 = 16.0
_EPS = 0.25
# A dropped key becomes -_DROP * u: logit about -_DROP, whose exp underflows to 0 in f64.
_DROP = 4000.0

# Worst row error (max |out - ref| / max |ref| over a row) a correct kernel stays under, by the
# dtype of its inputs, against the f64 oracle on the same rounded inputs (a different metric
# from _tolerances.py's elementwise atol/rtol). bf16: output rounding alone is up to 2^-9 =
# 0.2%; the XLA path and the kernels in their interpreters measured at most 0.6%; the broken
# kernels of tests/kernels/test_attention_checks.py at least 6% (one 16-token page of 32k
# tokens, H = 64), 15% at 4k-12k. f16: XLA measured 5e-4.
ROW_TOLERANCES = {
    jnp.dtype(jnp.bfloat16): 1.5e-2,
    jnp.dtype(jnp.float16): 2e-3,
}


@dataclasses.dataclass(frozen=True)
class PlantedCase:
    """One call's arguments on planted inputs, and what the oracle needs.

    Attributes:
      kind: "decode" (``jpaged.paged_attention``) or "ragged" (``ragged_paged_attention``).
      args: decode: (q[B, N, H], k_pages, v_pages, block_tables i32[B, W], lengths i32[B]);
        ragged: (q[T, N, H], k_pages, v_pages, block_tables, kv_lens i32[B], cu_q_lens
        i32[B + 1], num_seqs i32[]). Pages are [K, P, C, H] or [L, K, P, C, H], in ``dtype``.
      k_dense: f32[B, S, K, H] (or [L, B, S, K, H]) the rounded keys the pages hold.
      v_dense: like ``k_dense``.
      q_lens: the live sequences' query lengths (1 each for decode).
      plant_dir: f32[B, K, H] the planted direction ``u`` of each sequence and KV head.
      plant_every: g, tokens per block holding one planted key.
    """

    kind: str
    args: tuple
    k_dense: np.ndarray
    v_dense: np.ndarray
    q_lens: tuple[int, ...]
    plant_dir: np.ndarray
    plant_every: int

    @property
    def page_size(self) -> int:
        return self.args[1].shape[-2]

    @property
    def kv_lens(self) -> np.ndarray:
        """i32[B] keys per sequence (decode lengths or ragged kv_lens)."""
        return np.asarray(self.args[4])


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(jnp.dtype(dtype)).astype(np.float32)


def _unit_orthogonal(rng, u_KH: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Random unit vectors orthogonal to ``u_KH`` [K, H]: shape + [K, H]."""
    xi = rng.standard_normal((*shape, *u_KH.shape))
    xi -= np.sum(xi * u_KH, axis=-1, keepdims=True) * u_KH
    return xi / np.linalg.norm(xi, axis=-1, keepdims=True)


def _queries(rng, u_KH: np.ndarray, rows: int, num_q_heads: int) -> np.ndarray:
    """Query rows [rows, N, H] of one sequence: sqrt(H) (beta u + eps xi) per head."""
    K, H = u_KH.shape
    G = num_q_heads // K
    u_NH = np.repeat(u_KH, G, axis=0)
    # [rows, G, K, H] -> [rows, N, H]: query head n reads KV head n // G
    xi = _unit_orthogonal(rng, u_KH, (rows, G)).transpose(0, 2, 1, 3).reshape(rows, num_q_heads, H)
    beta = rng.uniform(0.95, 1.05, (rows, num_q_heads, 1))
    return math.sqrt(H) * (beta * u_NH + _EPS * xi)


def _planted_kv(rng, n: int, u_KH: np.ndarray, g: int, layers: int):
    """Keys and values [layers, n, K, H] of one sequence of n tokens (module docstring)."""
    K, H = u_KH.shape
    k = rng.standard_normal((layers, n, K, H))
    v = rng.standard_normal((layers, n, K, H))
    blocks = -(-n // g)
    if blocks == 0:
        return k, v
    starts = np.arange(blocks) * g
    sizes = np.minimum(g, n - starts)
    A = math.log(max(g - 1, 1)) + 0.46
    M = math.sqrt(blocks * min(blocks, H - 1))
    M0 = min(_M0, 2.0 * math.sqrt(blocks))  # a short row's P rounding would show at c*
    for layer in range(layers):
        for h in range(K):
            u = u_KH[h]
            pos = starts + (rng.random(blocks) * sizes).astype(np.int64)
            noise = k[layer, pos, h]
            noise -= (noise @ u)[:, None] * u
            a = A + rng.uniform(-0.5, 0.5, blocks)
            k[layer, pos, h] = a[:, None] * u + noise
            balance, *others = rng.permutation(H)
            codes = np.asarray(others)[np.arange(blocks) % (H - 1)]
            v[layer, :, h, balance] = -M0
            v[layer, pos, h] = 0.0
            v[layer, pos, h, codes] = rng.choice([-M, M], blocks)
            v[layer, pos, h, balance] = M0
    return k, v


def _fill_pages(pages: np.ndarray, table_W: np.ndarray, x_LnKH: np.ndarray) -> None:
    """Writes one sequence's rows [L, n, K, H] into ``pages`` [L, K, P, C, H] by its table."""
    L, n, K, H = x_LnKH.shape
    if n == 0:
        return
    C = pages.shape[-2]
    j = np.arange(n)
    flat = pages.reshape(L, K, -1, H)  # a view: [L, K, P * C, H]
    flat[:, :, table_W[j // C] * C + j % C] = x_LnKH.transpose(0, 2, 1, 3)


def _plant(rng, *, kv_lens, q_rows, q, pool, dtype, g: int, num_q_heads: int):
    """Overwrites the live sequences' keys, values and query rows with planted ones.

    ``pool`` is (k_pages, v_pages, block_tables, k_dense, v_dense) of ``make_paged_kv``'s
    layout; ``q_rows[b]`` is the (start, stop) of sequence b's rows in ``q``. Returns the new
    (q, k_pages, v_pages, k_dense, v_dense, plant_dir)."""
    k_pages, v_pages, tables, k_dense, v_dense = pool
    five_d = k_pages.ndim == 5
    k_pages = np.array(k_pages if five_d else k_pages[None], np.float32)
    v_pages = np.array(v_pages if five_d else v_pages[None], np.float32)
    k_dense = np.array(k_dense if five_d else k_dense[None])
    v_dense = np.array(v_dense if five_d else v_dense[None])
    q = np.array(q, np.float32)
    L, K, _, _, H = k_pages.shape
    u = rng.standard_normal((len(kv_lens), K, H))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    for b, n in enumerate(kv_lens):
        lo, hi = q_rows[b]
        q[lo:hi] = _rounded(_queries(rng, u[b], hi - lo, num_q_heads), dtype)
        k, v = (_rounded(x, dtype) for x in _planted_kv(rng, int(n), u[b], g, L))
        k_dense[:, b, :n], v_dense[:, b, :n] = k, v
        _fill_pages(k_pages, tables[b], k)
        _fill_pages(v_pages, tables[b], v)
    if not five_d:
        k_pages, v_pages, k_dense, v_dense = k_pages[0], v_pages[0], k_dense[0], v_dense[0]
    dt = jnp.dtype(dtype)
    return q.astype(dt), k_pages.astype(dt), v_pages.astype(dt), k_dense, v_dense, u


def planted_decode_case(
    rng: np.random.Generator,
    lengths,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.bfloat16,
    num_layers: int | None = None,
    width: int | None = None,
) -> PlantedCase:
    """Decode inputs (``jpaged.paged_attention``) with a planted key in every block.

    The layout is ``_paged_inputs.make_paged_kv``'s: a randomly permuted pool, NaN in free
    pages, in each last page's unused tail and behind unused table entries.

    Args:
      rng: NumPy generator.
      lengths: the B sequence lengths (0 allowed); sequence b's query sits at ``lengths[b]-1``.
      num_q_heads, num_kv_heads, head_dim, page_size: N, K, H, C.
      dtype: q and page dtype (the oracle reads the rounded values).
      num_layers: if given, pages are [L, K, P, C, H].
      width: W, default ``ceil(max(lengths) / C)``.
    """
    kv = make_paged_kv(
        rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        dtype=dtype, width=width, num_layers=num_layers,
    )  # fmt: skip
    B, g = len(kv.lengths), math.gcd(page_size, TILE)
    q = np.zeros((B, num_q_heads, head_dim), np.float32)
    pool = (kv.k_pages, kv.v_pages, kv.block_tables, kv.k_dense, kv.v_dense)
    q, k_pages, v_pages, k_dense, v_dense, u = _plant(
        rng, kv_lens=kv.lengths, q_rows=[(b, b + 1) for b in range(B)], q=q, pool=pool,
        dtype=dtype, g=g, num_q_heads=num_q_heads,
    )  # fmt: skip
    args = (q, k_pages, v_pages, kv.block_tables, kv.lengths)
    return PlantedCase(
        kind="decode", args=args, k_dense=k_dense, v_dense=v_dense, q_lens=(1,) * B,
        plant_dir=u, plant_every=g,
    )  # fmt: skip


def planted_ragged_case(
    rng: np.random.Generator,
    kv_lens,
    q_lens,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=jnp.bfloat16,
    num_layers: int | None = None,
) -> PlantedCase:
    """Ragged inputs (``jpaged.ragged_paged_attention``) with a planted key in every block.

    The layout is ``test_ragged_reference.make_ragged_case``'s (permuted NaN-poisoned pool,
    padding rows of q after the live ones, a dead sequence past ``num_seqs``); the live
    sequences' keys, values and query rows are replaced by planted ones.

    Args:
      rng: NumPy generator.
      kv_lens: keys per live sequence, its query rows' own included.
      q_lens: query rows per live sequence (each <= its kv length); row i of sequence b sits
        at position ``kv_lens[b] - q_lens[b] + i``.
      num_q_heads, num_kv_heads, head_dim, page_size, dtype, num_layers: as in
        ``planted_decode_case``.
    """
    base = make_ragged_case(
        rng, kv_lens, q_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, dtype=dtype, num_layers=num_layers,
    )  # fmt: skip
    q, k_pages, v_pages, tables, lens, cu, ns = base.args
    live = len(kv_lens)
    pool = (k_pages, v_pages, tables, base.k_dense, base.v_dense)
    q, k_pages, v_pages, k_dense, v_dense, u = _plant(
        rng, kv_lens=np.asarray(kv_lens, np.int64),
        q_rows=[(int(cu[b]), int(cu[b + 1])) for b in range(live)], q=q, pool=pool,
        dtype=dtype, g=math.gcd(page_size, TILE), num_q_heads=num_q_heads,
    )  # fmt: skip
    u = np.concatenate([u, np.zeros((len(lens) - live, *u.shape[1:]))])  # dead sequences
    return PlantedCase(
        kind="ragged", args=(q, k_pages, v_pages, tables, lens, cu, ns), k_dense=k_dense,
        v_dense=v_dense, q_lens=tuple(q_lens), plant_dir=u, plant_every=math.gcd(page_size, TILE),
    )  # fmt: skip


def reference(
    case: PlantedCase,
    *,
    sm_scale: float | None = None,
    layer: int | None = None,
    drop: np.ndarray | None = None,
) -> np.ndarray:
    """The f64 oracle on the case's rounded inputs: [B, N, H] (decode) or [T, N, H] (ragged).

    Args:
      case: a planted case.
      sm_scale: logit scale, default 1/sqrt(H).
      layer: the layer of a 5-D pool.
      drop: optional bool[B, S]: keys to leave out, as a kernel that skips them would (used by
        the meta-tests' broken kernels). A dropped key is replaced by ``-4000 u``: its logit,
        about -4000, underflows to an exact 0 weight in f64 beside any visible key.
    """
    k = case.k_dense if layer is None else case.k_dense[layer]
    v = case.v_dense if layer is None else case.v_dense[layer]
    if drop is not None:
        k, v = k.copy(), v.copy()
        b, j = np.nonzero(drop[:, : k.shape[1]])
        k[b, j] = -_DROP * case.plant_dir[b]
        v[b, j] = 0.0
    q = np.asarray(case.args[0], np.float32)
    if case.kind == "decode":
        return dense_attention(q, k, v, case.kv_lens, sm_scale=sm_scale)
    ragged = RaggedCase(args=(q, *case.args[1:]), k_dense=k, v_dense=v, q_lens=case.q_lens)
    return dense_ragged_attention(ragged, sm_scale=sm_scale)


def row_errors(out, ref) -> np.ndarray:
    """Per-row error: max_h |out - ref| / max_h |ref| over the last axis, as f64[rows].

    A row whose reference is all zeros (a length-0 sequence, a padding row) is divided by
    1e-30 instead, so anything but zeros there fails; a non-finite output gives inf.
    """
    out = np.asarray(out, np.float32).astype(np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    H = out.shape[-1]
    out, ref = out.reshape(-1, H), ref.reshape(-1, H)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.max(np.abs(out - ref), axis=-1) / np.maximum(np.max(np.abs(ref), -1), 1e-30)
    return np.where(np.all(np.isfinite(out), axis=-1), err, np.inf)


def assert_rows_close(out, ref, dtype, *, tol: float | None = None, err_msg: str = "") -> float:
    """Asserts every row of ``out`` [..., H] is within ``tol`` of ``ref`` (``row_errors``).

    Args:
      out: the kernel's output (any float dtype).
      ref: the f64 oracle, same shape.
      dtype: the inputs' dtype, which picks the tolerance (``ROW_TOLERANCES``).
      tol: overrides the table.
      err_msg: prefixed to the failure message.

    Returns:
      The worst row's error.

    Raises:
      AssertionError: naming the worst row (its index over the leading axes), its error, and
        how many rows exceed the tolerance.
    """
    tol = ROW_TOLERANCES[jnp.dtype(dtype)] if tol is None else tol
    err = row_errors(out, ref)
    worst = int(np.argmax(err))
    if err[worst] > tol:
        index = np.unravel_index(worst, np.shape(ref)[:-1])
        raise AssertionError(
            f"{err_msg}: worst row {tuple(int(i) for i in index)} has error {err[worst]:.3g} "
            f"(max |out - ref| / max |ref| over the row) > {tol:.3g}; "
            f"{int(np.sum(err > tol))} of {err.size} rows over; median row {np.median(err):.2g}"
        )
    return float(err[worst])
