"""The Llama family (Llama 2/3, Mistral, Qwen2, Gemma 2) as one Flax NNX module on the paged
cache.

One implementation, switched by ``ModelConfig``: RMSNorm (Gemma's ``1 + weight``), GQA
attention with RoPE (Llama 3 scaling), optional sliding windows (every layer: Mistral;
alternating local/global layers: Gemma 2), optional q/k/v biases (Qwen2), a gated MLP (SiLU
or gelu-tanh), Gemma 2's logit soft caps, query pre-attention scalar, post-attention and
post-feedforward norms and sqrt(D) embedding scale, tied or untied embeddings. Layer
parameters are stacked with a leading L axis (q/k/v and gate/up fused into one GEMM each) and
the layers run under ``jax.lax.scan``, so compile time does not grow with depth; a model whose
layers' windows repeat with period p (Gemma 2: p = 2) scans L / p groups of p layers, each
layer with its window as a static argument of the attention op. In the paged forward the cache
is the scan's carry and each layer writes and reads its own slice of the stacked pool by index
(never slicing the pool). On CUDA
GPUs the engine compiles with cuBLAS GEMMs reading each layer's weights in place
(``jpaged.engine.runner.GPU_COMPILER_OPTIONS``): XLA's default Triton GEMMs made it copy them first.
Jitting the model yourself, pass ``jax.jit(..., compiler_options=
jpaged.default_compiler_options() or None)`` for the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.kv.layer_groups import group_layer_indices, local_window
from jpaged.models._config import ModelConfig
from jpaged.models._protocol import AttentionMetadata, paged_attention_layer
from jpaged.models._rope import apply_rope, inverse_frequencies

_INIT_STD = 0.02  # Hugging Face's default `initializer_range`.
# ``lax.scan``'s ``unroll`` over the layers. Unrolling did not stop XLA's Triton GEMMs on GPU
# from copying the weights (H200, 8B, B=64: 13.1 ms per decode step unrolled, 13.4 rolled);
# cuBLAS with dynamic-slice fusion did (6.3 ms, rolled), see ``GPU_COMPILER_OPTIONS``.
LAYER_SCAN_UNROLL: int | bool = 1


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model by name, with its shape (stacked layers lead with L).

    The names are the keys of ``LlamaForCausalLM(params=...)`` and of the loader's mapping.
    """
    c = config
    L, D, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    shapes = {
        "embed_VD": (V, D),
        "norm_D": (D,),
        "layers.attn_norm_LD": (L, D),
        "layers.wq_LDNH": (L, D, N, H),
        "layers.wk_LDKH": (L, D, K, H),
        "layers.wv_LDKH": (L, D, K, H),
        "layers.wo_LNHD": (L, N, H, D),
        "layers.mlp_norm_LD": (L, D),
        "layers.w_gate_LDF": (L, D, F),
        "layers.w_up_LDF": (L, D, F),
        "layers.w_down_LFD": (L, F, D),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head_DV"] = (D, V)
    if c.qkv_bias:
        shapes |= {
            "layers.bq_LNH": (L, N, H),
            "layers.bk_LKH": (L, K, H),
            "layers.bv_LKH": (L, K, H),
        }
    if c.o_bias:
        shapes["layers.bo_LD"] = (L, D)
    if c.mlp_bias:
        shapes |= {"layers.b_gate_LF": (L, F), "layers.b_up_LF": (L, F), "layers.b_down_LD": (L, D)}
    if c.post_norms:
        shapes |= {"layers.post_attn_norm_LD": (L, D), "layers.post_mlp_norm_LD": (L, D)}
    return shapes


def _draw(shapes: Mapping[str, tuple[int, ...]], key: jax.Array, dtype: Any, norm: float) -> dict:
    """normal(0.02) weights, norm weights ``norm``, zero biases; weights from one flat draw."""
    params, weights = {}, {}
    for name, shape in shapes.items():
        if "norm" in name:
            params[name] = jnp.full(shape, norm, dtype)
        elif name.split(".")[-1].startswith("b"):
            params[name] = jnp.zeros(shape, dtype)
        else:
            weights[name] = shape
    flat = jax.random.normal(key, (sum(math.prod(s) for s in weights.values()),), dtype)
    flat = flat * jnp.asarray(_INIT_STD, dtype)
    offset = 0
    for name, shape in weights.items():
        size = math.prod(shape)
        params[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return params


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def _random_params(config: ModelConfig, key: jax.Array, dtype: Any) -> dict[str, jax.Array]:
    """Random init in one jitted call, on device.

    Layers are drawn one at a time under ``lax.map``, so temporaries stay at one layer's size
    (the RNG's bits are several times the weights), and one flat draw per program (instead of
    one per parameter) keeps the compile short.
    """
    shapes = param_shapes(config)
    top = {n: s for n, s in shapes.items() if not n.startswith("layers.")}
    per_layer = {n: s[1:] for n, s in shapes.items() if n.startswith("layers.")}
    key_top, key_layers = jax.random.split(key)
    norm = 0.0 if config.norm_unit_offset else 1.0  # unit scale either way
    params = _draw(top, key_top, dtype, norm)
    layer_keys = jax.random.split(key_layers, config.num_layers)
    params |= jax.lax.map(lambda k: _draw(per_layer, k, dtype, norm), layer_keys)
    return params


# Parameters that run as one GEMM, stored concatenated along their output axis (as loaded
# checkpoints are fused by vLLM): q/k/v and gate/up. Separate sibling GEMMs over one input
# made XLA (GPU) concatenate their weights again on every call: a copy of most of the
# weights per decode step.
_FUSED = {
    "wqkv_LDX": ("wq_LDNH", "wk_LDKH", "wv_LDKH"),
    "bqkv_LX": ("bq_LNH", "bk_LKH", "bv_LKH"),
    "w_gate_up_LDX": ("w_gate_LDF", "w_up_LDF"),
    "b_gate_up_LX": ("b_gate_LF", "b_up_LF"),
}


def _fuse_with(xp, params: dict) -> dict:
    out = dict(params)
    for fused, parts in _FUSED.items():
        if parts[0] in params:
            flat = [out.pop(n) for n in parts]
            lead = 2 if "_LD" in fused else 1  # [L, D, ...] weights, [L, ...] biases
            out[fused] = xp.concatenate([x.reshape(*x.shape[:lead], -1) for x in flat], axis=-1)
    return out


_fuse_on_device = jax.jit(functools.partial(_fuse_with, jnp))


def _fuse(params: dict) -> dict[str, jax.Array]:
    """The fused layer parameters, on device. Host (NumPy) inputs are fused on the host, so
    loading a checkpoint never holds the fused and unfused weights on the device at once."""
    if all(isinstance(v, np.ndarray) for v in params.values()):
        return {k: jnp.asarray(v) for k, v in _fuse_with(np, params).items()}
    return _fuse_on_device(params)


class DecoderLayers(nnx.Module):
    """The L decoder layers, each parameter stacked along a leading L axis.

    q/k/v and gate/up are stored fused (``wqkv_LDX`` = [wq | wk | wv] over (N + 2K) * H
    outputs, ``w_gate_up_LDX`` = [gate | up] over 2F); ``unfused()`` gives them by their
    ``param_shapes`` names.
    """

    def __init__(self, params: Mapping[str, jax.Array], config: ModelConfig):
        self.config = config
        for name, value in _fuse(dict(params)).items():
            setattr(self, name, nnx.Param(value))

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked (fused) parameter arrays by name (leading L axis)."""
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    def unfused(self) -> dict[str, jax.Array]:
        """Every layer parameter by its ``param_shapes`` name (slices of the fused arrays)."""
        c = self.config
        L, D, F = c.num_layers, c.hidden_size, c.intermediate_size
        N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
        out = self.arrays()
        sizes = {"wqkv_LDX": [(N, H), (K, H), (K, H)], "bqkv_LX": [(N, H), (K, H), (K, H)],
                 "w_gate_up_LDX": [(F,), (F,)], "b_gate_up_LX": [(F,), (F,)]}  # fmt: skip
        for fused, parts in _FUSED.items():
            if fused not in out:
                continue
            x, start = out.pop(fused), 0
            lead = (L, D) if "_LD" in fused else (L,)
            for name, shape in zip(parts, sizes[fused], strict=True):
                n = math.prod(shape)
                out[name] = x[..., start : start + n].reshape(*lead, *shape)
                start += n
        return out


def layer_qkv(c: ModelConfig, p: Mapping[str, jax.Array], x: jax.Array, positions: jax.Array,
              inv_freq: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """One layer's q [..., N, H], k and v [..., K, H] (RoPE applied) from its input ``x``.

    ``p``: the layer's parameters (``DecoderLayers.arrays()`` names, one layer's slice).
    """
    N, K, H = c.num_heads, c.num_kv_heads, c.head_dim
    h = _rms_norm(c, x, p["attn_norm_LD"])
    qkv = jnp.einsum("...d,dx->...x", h, p["wqkv_LDX"])
    if c.qkv_bias:
        qkv = qkv + p["bqkv_LX"]
    lead = qkv.shape[:-1]
    q = qkv[..., : N * H].reshape(*lead, N, H)
    k = qkv[..., N * H : (N + K) * H].reshape(*lead, K, H)
    v = qkv[..., (N + K) * H :].reshape(*lead, K, H)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def layer_out_mlp(c: ModelConfig, p: Mapping[str, jax.Array], x: jax.Array,
                  o: jax.Array, *, shard_axis: str | None = None) -> jax.Array:  # fmt: skip
    """The rest of the layer after attention: output projection (then the post-attention
    norm), residual, gated MLP (then the post-feedforward norm), residual.

    ``shard_axis``: the mesh axis when ``p`` holds one device's heads and MLP columns
    (``jpaged.parallel``): the two row-parallel projections are summed over it (before the
    post-norms, which need the whole vector).
    """
    F = c.intermediate_size
    # Split, the partial sums stay f32 through the all-reduce and are rounded once, as the
    # one-device GEMM rounds its f32 accumulator once (bf16 partials rounded per device
    # changed greedy tokens of the bf16 test checkpoints at TP=2).
    acc = None if shard_axis is None else jnp.float32
    attn = jnp.einsum("...nh,nhd->...d", o.astype(x.dtype), p["wo_LNHD"],
                      preferred_element_type=acc)  # fmt: skip
    attn = _sum_over_shards(attn, shard_axis).astype(x.dtype)
    if c.o_bias:
        attn = attn + p["bo_LD"]
    if c.post_norms:
        attn = _rms_norm(c, attn, p["post_attn_norm_LD"])
    x = x + attn
    h = _rms_norm(c, x, p["mlp_norm_LD"])
    gate_up = jnp.einsum("...d,dx->...x", h, p["w_gate_up_LDX"])
    if c.mlp_bias:
        gate_up = gate_up + p["b_gate_up_LX"]
    gate = gate_up[..., :F]
    gate = jax.nn.silu(gate) if c.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    down = jnp.einsum("...f,fd->...d", gate * gate_up[..., F:], p["w_down_LFD"],
                      preferred_element_type=acc)  # fmt: skip
    down = _sum_over_shards(down, shard_axis).astype(x.dtype)
    if c.mlp_bias:
        down = down + p["b_down_LD"]
    if c.post_norms:
        down = _rms_norm(c, down, p["post_mlp_norm_LD"])
    return x + down


def _sum_over_shards(x: jax.Array, axis: str | None) -> jax.Array:
    """The all-reduce of a row-parallel projection's partial sums (identity on one device)."""
    return x if axis is None else jax.lax.psum(x, axis)


def _embed(table_VD: jax.Array, tokens: jax.Array, axis: str | None) -> jax.Array:
    """Embedding lookup; with ``axis``, ``table_VD`` is this device's block of rows (the
    vocabulary split in equal blocks along the axis) and the rows are summed over it."""
    if axis is None:
        return table_VD[tokens]
    V_local = table_VD.shape[0]
    local = tokens - jax.lax.axis_index(axis) * V_local
    mine = (local >= 0) & (local < V_local)
    rows = table_VD[jnp.clip(local, 0, V_local - 1)]
    return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros_like(rows)), axis)


def _rms_norm(c: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    # As Hugging Face: normalize in f32; Llama casts back then scales, Gemma scales by
    # (1 + weight) in f32 then casts back.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + c.rms_norm_eps)
    if c.norm_unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def _dense_causal_attention(
    c: ModelConfig, q_BSNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
    sliding_window: int | None,
) -> jax.Array:  # fmt: skip
    """Plain causal (optionally sliding-window, soft-capped) attention, softmax in f32."""
    B, S, N, H = q_BSNH.shape
    K = k_BSKH.shape[2]
    q_BSKGH = q_BSNH.reshape(B, S, K, N // K, H)
    s_BKGST = jnp.einsum(
        "bskgh,btkh->bkgst", q_BSKGH, k_BSKH, preferred_element_type=jnp.float32
    ) * jnp.float32(c.sm_scale)
    s_BKGST = _soft_cap(s_BKGST, c.attn_logit_softcapping)
    pos_q, pos_k = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    visible_ST = pos_k <= pos_q
    if sliding_window is not None:
        visible_ST &= pos_q - pos_k < sliding_window
    s_BKGST = jnp.where(visible_ST, s_BKGST, -jnp.inf)
    p_BKGST = jax.nn.softmax(s_BKGST, axis=-1).astype(v_BSKH.dtype)
    o_BSKGH = jnp.einsum("bkgst,btkh->bskgh", p_BKGST, v_BSKH)
    return o_BSKGH.reshape(B, S, N, H)


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Gemma 2) on the paged cache.

    Build it random (``LlamaForCausalLM(config, rngs=nnx.Rngs(0))``, or jitted on device with
    ``init_random``) or from a Hugging Face checkpoint (``jpaged.models.from_pretrained``).

    Attributes:
      config: the ``ModelConfig``.
      embed_VD: [V, D] token embeddings.
      layers: ``DecoderLayers`` (stacked [L, ...] parameters, see ``param_shapes``).
      norm_D: [D] final RMSNorm weight.
      lm_head_DV: [D, V] output projection (None when tied to ``embed_VD``).
      shard_axis: None, or the mesh axis when this module is one device's shard of a
        tensor-parallel model (``jpaged.parallel``).
      supports_page_groups: True: with a pool of two page groups (a model mixing windowed
        and full-attention layers), each layer reads its group's metadata and pool slice.
    """

    supports_page_groups: ClassVar[bool] = True

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs | None = None,
        params: Mapping[str, jax.Array] | None = None,
        dtype: Any = jnp.float32,
        shard_axis: str | None = None,
    ):
        """Builds the model from ``params`` (as ``param_shapes`` names them) or at random.

        Args:
          config: the model's shapes and switches.
          rngs: random init (normal(0.02) weights, unit norms, zero biases) when ``params``
            is None.
          params: parameter arrays by name (device or NumPy arrays, moved to the default
            device); used in their dtype (cast them beforehand).
          dtype: parameter dtype for random init.
          shard_axis: set by ``jpaged.parallel`` on one device's shard of a tensor-parallel
            model (its config has the device's heads, MLP columns and vocabulary rows): the
            forward then runs inside ``shard_map`` over this mesh axis, all-reduces the
            attention and MLP outputs, and returns the logits of the whole (padded)
            vocabulary. None: the whole model on one device.

        Raises:
          ValueError: if neither or both of ``rngs``/``params`` are given, or a parameter is
            missing, unexpected or of the wrong shape.
        """
        self.config = config
        self.shard_axis = shard_axis
        shapes = param_shapes(config)
        if (rngs is None) == (params is None):
            raise ValueError("pass exactly one of rngs= (random init) or params= (loaded)")
        if params is None:
            params = _random_params(config, rngs.params(), jnp.dtype(dtype))
        _check_params(params, shapes)
        self.embed_VD = nnx.Param(jnp.asarray(params["embed_VD"]))
        self.norm_D = nnx.Param(jnp.asarray(params["norm_D"]))
        self.lm_head_DV = (
            None if config.tie_word_embeddings else nnx.Param(jnp.asarray(params["lm_head_DV"]))
        )
        self.layers = DecoderLayers(
            {k.removeprefix("layers."): v for k, v in params.items() if k.startswith("layers.")},
            config,
        )

    # --- the protocol's attributes ---
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _run_layers(
        self,
        x: jax.Array,
        positions: jax.Array,
        carry: Any,
        attend: Callable[..., tuple[jax.Array, Any]],
    ) -> tuple[jax.Array, Any]:
        """Runs the L layers under ``lax.scan``; ``x``: [..., D], ``positions``: i32[...].

        ``attend(q, k, v, carry, layer, window)``: ``layer`` an i32[] index, ``window`` the
        layer's static sliding window. Layers whose windows repeat with period p run as a
        scan over L / p groups of p layers (p = 1: one layer per iteration).
        """
        c = self.config
        inv_freq = inverse_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        period = c.layer_period
        windows = c.layer_windows[:period]

        def layer(state, xs):
            x, carry = state
            group, first = xs
            for j, window in enumerate(windows):
                p = group if period == 1 else {n: a[j] for n, a in group.items()}
                q, k, v = layer_qkv(c, p, x, positions, inv_freq)
                o, carry = attend(q, k, v, carry, first + j, window)
                x = layer_out_mlp(c, p, x, o, shard_axis=self.shard_axis)
            return (x, carry), None

        params = self.layers.arrays()
        if period > 1:  # [L, ...] -> [L / p, p, ...]: splits the leading axis, no copy
            params = {n: a.reshape(-1, period, *a.shape[1:]) for n, a in params.items()}
        xs = (params, jnp.arange(0, c.num_layers, period, dtype=jnp.int32))
        (x, carry), _ = jax.lax.scan(layer, (x, carry), xs, unroll=LAYER_SCAN_UNROLL)
        return x, carry

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = _embed(self.embed_VD[...], tokens, self.shard_axis)
        if self.config.scale_embeddings:  # as Gemma: sqrt(D) rounded to the weights' dtype
            x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
        return x

    def _logits(self, x: jax.Array) -> jax.Array:
        x = _rms_norm(self.config, x, self.norm_D[...])
        if self.lm_head_DV is None:
            logits = jnp.einsum(
                "...d,vd->...v", x, self.embed_VD[...], preferred_element_type=jnp.float32
            )
        else:
            logits = jnp.einsum(
                "...d,dv->...v", x, self.lm_head_DV[...], preferred_element_type=jnp.float32
            )
        if self.shard_axis is not None:
            logits = jax.lax.all_gather(logits, self.shard_axis, axis=logits.ndim - 1, tiled=True)
        return _soft_cap(logits, self.config.final_logit_softcapping)

    def __call__(
        self,
        tokens_T: jax.Array,
        positions_T: jax.Array,
        cache: Any,
        metadata: AttentionMetadata,
        *,
        decode: bool = False,
        implementation: str | None = None,
    ) -> tuple[jax.Array, Any]:
        """The paged forward: prefill, chunked prefill, decode and mixed batches.

        Args:
          tokens_T: i32[T] a ragged batch of query tokens (see ``AttentionMetadata``).
          positions_T: i32[T] each token's position in its sequence.
          cache: ``jpaged.PagedKVCache`` with ``[L, K, P, C, H]`` pages.
          metadata: where the batch's tokens live in the cache.
          decode: static; True when every sequence has exactly one query token (T == B):
            uses the decode attention kernel.
          implementation: attention implementation (None: auto).

        Returns:
          ``(logits_RV, cache)``: f32 logits of the rows ``metadata.logits_indices`` and the
          cache with this batch's K/V written.
        """
        x_TD = self._embed(tokens_T)
        c = self.config
        slices = None
        if metadata.grouped:  # two page groups: each layer reads its group's slice and tables
            slices = group_layer_indices(c.layer_windows)
            if local_window(c.layer_windows) is None or cache.k_pages.shape[0] != max(slices) + 1:
                raise ValueError(
                    f"a pool of two page groups needs a model mixing local and global layers "
                    f"and a pool of {max(slices) + 1} layer slices; got layer windows "
                    f"{c.layer_windows} and {cache.k_pages.shape[0]} slices"
                )

        def attend(q, k, v, cache, layer, window):
            meta = metadata
            if slices is not None:
                meta = metadata if window is None else metadata.local_group()
                layer = jnp.asarray(slices, jnp.int32)[layer]
            return paged_attention_layer(
                q, k, v, cache, layer, meta, sm_scale=c.sm_scale, sliding_window=window,
                logits_soft_cap=c.attn_logit_softcapping, decode=decode,
                implementation=implementation,
            )  # fmt: skip

        x_TD, cache = self._run_layers(x_TD, positions_T, cache, attend)
        return self._logits(x_TD[metadata.logits_indices]), cache

    def forward_dense(self, tokens_BS: jax.Array) -> jax.Array:
        """The plain forward without a cache (tests, scoring): causal over S tokens.

        Args:
          tokens_BS: i32[B, S] token ids; every sequence starts at position 0.

        Returns:
          f32[B, S, V] logits at every position.
        """
        B, S = tokens_BS.shape
        x_BSD = self._embed(tokens_BS)
        positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))

        def attend(q, k, v, carry, layer, window):
            return _dense_causal_attention(self.config, q, k, v, window), carry

        x_BSD, _ = self._run_layers(x_BSD, positions_BS, None, attend)
        return self._logits(x_BSD)


def _check_params(params: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    errors = []
    missing = sorted(set(shapes) - set(params))
    unexpected = sorted(set(params) - set(shapes))
    if missing:
        errors.append(f"missing parameters {missing}")
    if unexpected:
        errors.append(f"unexpected parameters {unexpected}")
    for name in sorted(set(shapes) & set(params)):
        if tuple(params[name].shape) != shapes[name]:
            errors.append(f"{name}.shape={tuple(params[name].shape)} must be {shapes[name]}")
    if errors:
        raise ValueError("; ".join(errors))


def init_random(
    config: ModelConfig, *, seed: int = 0, dtype: Any = jnp.bfloat16
) -> LlamaForCausalLM:
    """A random-weight model whose weights are created on the default device.

    For benchmarks at real sizes (``llama3_8b()``, ``llama3_2_1b()``) without a checkpoint:
    one jitted call draws every parameter on device (nothing is built on the host). Peak
    device memory is about 2.2x the weights (XLA's memory analysis for ``llama3_8b()`` in
    bf16: 16.1 GB of weights + 18.6 GB of temporaries, mostly the embedding draws).

    Args:
      config: the model's shapes.
      seed: PRNG seed.
      dtype: parameter dtype.

    Returns:
      A ``LlamaForCausalLM`` whose parameters live on the default device.
    """
    return LlamaForCausalLM(config, rngs=nnx.Rngs(seed), dtype=dtype)
