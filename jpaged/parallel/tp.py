"""Tensor parallelism: a Llama-family model split over a mesh axis, run under ``shard_map``.

`TensorParallelModel` is a `jpaged.models.PagedModel`: the engine runs it as it runs a
one-device model. Its forward is one ``shard_map`` over the mesh: each device runs the
ordinary ``LlamaForCausalLM`` forward on its own heads, MLP columns and vocabulary rows (the
`TensorParallelLayout`), with its own part of the paged pool ``[L, K_local, P, C, H]``, so
every attention implementation (XLA, the Pallas kernels) sees one device's shapes only.
Inside, the model all-reduces the attention and MLP outputs of each layer and all-gathers
the logits; block tables, lengths and every other input are replicated.

Build one with `shard_model` (from a model in memory) or `build_model` (from a reader of
the checkpoint's tensors: ``jpaged.models.from_pretrained(path, mesh=...)``), and its pool
with `create_cache`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.kv.cache import PagedKVCache
from jpaged.models._llama import LlamaForCausalLM, param_shapes
from jpaged.models._protocol import AttentionMetadata
from jpaged.parallel.layout import MODEL_AXIS, Reader, TensorParallelLayout

__all__ = [
    "TensorParallelModel",
    "build_model",
    "cache_shardings",
    "create_cache",
    "data_replicas",
    "shard_model",
]


def _path_name(path) -> str:
    """``nnx`` state path -> "layers.wqkv_LDX" (the Variable's ``value`` key dropped)."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return ".".join(str(k) for k in keys if k != "value")


class TensorParallelModel(nnx.Module):
    """A Llama-family model split over the mesh axis ``layout.axis`` (a ``PagedModel``).

    Attributes:
      config: the whole model's ``ModelConfig``.
      layout: the `TensorParallelLayout` (which device holds what).
      mesh: the mesh; axes other than ``layout.axis`` hold copies.
      shard: a ``LlamaForCausalLM`` with ``layout.local_config`` whose arrays are the global
        arrays (each device's block along the split axis is its one-device model).
    """

    def __init__(self, shard: LlamaForCausalLM, layout: TensorParallelLayout, mesh: Mesh):
        self.config = layout.config
        self.layout = layout
        self.mesh = mesh
        self.shard = shard

    # --- the protocol's attributes (the pool's KV-head axis holds every device's heads) ---
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.layout.pool_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def supports_page_groups(self) -> bool:
        return bool(getattr(self.shard, "supports_page_groups", False))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def cache_specs(self, cache: Any) -> Any:
        """PartitionSpecs of a pool pytree: arrays whose axis 1 is the pool's KV-head axis
        are split on it, anything else (scalars, per-tensor scales) replicated."""
        K, axis = self.layout.pool_kv_heads, self.layout.axis

        def spec(x):
            shape = getattr(x, "shape", ())
            return P(None, axis) if len(shape) >= 2 and shape[1] == K else P()

        return jax.tree.map(spec, cache)

    def _per_device(self, method: Callable, args: tuple, arg_specs: tuple, out_specs: Any):
        """``method(shard, *args)`` on every device's block under ``shard_map``."""
        graphdef, state = nnx.split(self.shard)
        state_specs = jax.tree_util.tree_map_with_path(
            lambda path, x: self.layout.param_spec(_path_name(path), x.ndim), state
        )

        def body(state, *args):
            return method(nnx.merge(graphdef, state), *args)

        # Outputs specified replicated are: the logits come out of an all-gather and the
        # residual stream out of all-reduces (check_vma would take them for per-device values).
        run = jax.shard_map(
            body, mesh=self.mesh, in_specs=(state_specs, *arg_specs), out_specs=out_specs,
            check_vma=False,
        )  # fmt: skip
        return run(state, *args)

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
        """The paged forward (``LlamaForCausalLM.__call__``'s contract), split over devices.

        ``cache``: the pool split by `create_cache` (``[L, size * K_local, P, C, H]``).
        """

        def forward(shard, tokens, positions, cache, metadata):
            return shard(tokens, positions, cache, metadata, decode=decode,
                         implementation=implementation)  # fmt: skip

        specs = self.cache_specs(cache)
        logits_RV, cache = self._per_device(
            forward, (tokens_T, positions_T, cache, metadata), (P(), P(), specs, P()), (P(), specs)
        )
        return logits_RV[..., : self.vocab_size], cache

    def forward_dense(self, tokens_BS: jax.Array) -> jax.Array:
        """``LlamaForCausalLM.forward_dense`` split over devices: f32[B, S, V] logits."""
        logits = self._per_device(
            lambda shard, t: shard.forward_dense(t), (tokens_BS,), (P(),), P()
        )
        return logits[..., : self.vocab_size]


# ----------------------------------------------------------------------------- building


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked: jax.Array, block: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stacked, block, layer, 0)


def _global_array(
    layout: TensorParallelLayout, mesh: Mesh, name: str, local: jax.ShapeDtypeStruct,
    read: Reader,
) -> jax.Array:  # fmt: skip
    """The global state array ``name`` from each device's blocks, one layer at a time (host
    memory holds one device's block of one layer's tensor at a time)."""
    spec = layout.param_spec(name, len(local.shape))
    split = next((i for i, a in enumerate(spec) if a is not None), None)
    shape = list(local.shape)
    if split is not None:
        shape[split] *= layout.size
    dtype = local.dtype

    def block(index, layer):
        device = 0 if split is None else (index[split].start or 0) // local.shape[split]
        return np.asarray(layout.device_block(name, device, layer, read), dtype)

    if not name.startswith("layers."):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(tuple(shape), sharding, lambda i: block(i, None))
    layer_spec = P(*spec[1:])
    layer_sharding = NamedSharding(mesh, layer_spec)
    stacked = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()
    for layer in range(shape[0]):
        one = jax.make_array_from_callback(
            tuple(shape[1:]), layer_sharding,
            lambda i, layer=layer: block((slice(None), *i), layer),
        )  # fmt: skip
        stacked = _set_layer(stacked, one, np.int32(layer))
    return stacked


def build_model(layout: TensorParallelLayout, mesh: Mesh, read: Reader, dtype: Any) -> (
    TensorParallelModel
):  # fmt: skip
    """A `TensorParallelModel` whose arrays are built on each device from ``read``.

    Args:
      layout: the split (its axis must be an axis of ``mesh``).
      mesh: the devices; axes other than ``layout.axis`` get copies.
      read: ``read(name, layer, axis, lo, hi)``: rows ``[lo, hi)`` along ``axis`` of one
        layer's tensor ``name`` (``param_shapes`` names, without "layers."; ``axis`` None:
        the whole tensor), as a NumPy array in jpaged's layout.
      dtype: the parameters' dtype.

    Raises:
      ValueError: ``layout.axis`` is not an axis of ``mesh`` or its size is not
        ``layout.size``.
    """
    _check_axis(mesh, layout)
    local = layout.local_config
    zeros = {k: jnp.zeros(s, dtype) for k, s in param_shapes(local).items()}
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(local, params=zeros, shard_axis=layout.axis))
    graphdef, abstract_state = nnx.split(abstract)
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: _global_array(layout, mesh, _path_name(path), x, read), abstract_state
    )
    return TensorParallelModel(nnx.merge(graphdef, state), layout, mesh)


def _check_axis(mesh: Mesh, layout: TensorParallelLayout) -> None:
    """Raises ValueError unless ``layout.axis`` is an axis of ``mesh`` of ``layout.size``."""
    if layout.axis not in mesh.shape or mesh.shape[layout.axis] != layout.size:
        raise ValueError(
            f"the mesh {dict(mesh.shape)} must have an axis {layout.axis!r} of size "
            f"{layout.size} (the tensor parallel size)"
        )


def _module_reader(model: LlamaForCausalLM) -> Reader:
    """A reader over a model's own arrays (one layer's slice copied to the host per read)."""
    arrays = dict(model.layers.unfused())
    arrays["embed_VD"], arrays["norm_D"] = model.embed_VD[...], model.norm_D[...]
    if model.lm_head_DV is not None:
        arrays["lm_head_DV"] = model.lm_head_DV[...]

    def read(name, layer, axis, lo, hi):
        x = arrays[name] if layer is None else arrays[name][layer]
        if axis is not None:
            x = jax.lax.slice_in_dim(x, lo, hi, axis=axis)
        return np.asarray(x)

    return read


def shard_model(
    model: LlamaForCausalLM | TensorParallelModel, mesh: Mesh, *, axis: str = MODEL_AXIS
) -> TensorParallelModel:
    """``model`` split over the axis ``axis`` of ``mesh`` (a model already split over that
    mesh and axis is returned as is).

    The devices' blocks are copied from the model's arrays one layer at a time; the model
    keeps its own arrays (to load a checkpoint straight into the devices, use
    ``jpaged.models.from_pretrained(path, mesh=mesh)``).

    Raises:
      ValueError: ``model`` is not a ``LlamaForCausalLM``, ``axis`` is not in ``mesh``, or
        the model's heads do not split over its size.
    """
    if isinstance(model, TensorParallelModel):
        same_devices = set(model.mesh.devices.flat) == set(mesh.devices.flat)
        if same_devices and model.layout.axis == axis and model.layout.size == mesh.shape.get(axis):
            return model
        raise ValueError(
            f"the model is split over {dict(model.mesh.shape)} already; shard the unsplit "
            f"model for the mesh {dict(mesh.shape)}"
        )
    if not isinstance(model, LlamaForCausalLM) or model.shard_axis is not None:
        raise ValueError(
            "tensor parallelism splits jpaged.models.LlamaForCausalLM models; got "
            f"{type(model).__name__}"
        )
    if axis not in mesh.shape:
        raise ValueError(f"the mesh {dict(mesh.shape)} has no axis {axis!r}")
    layout = TensorParallelLayout(model.config, int(mesh.shape[axis]), axis)
    return build_model(layout, mesh, _module_reader(model), model.embed_VD[...].dtype)


def data_replicas(model: TensorParallelModel, data_axis: str) -> list[TensorParallelModel]:
    """One model per index of the mesh axis ``data_axis``, each on its own devices (a mesh
    of the remaining axes), sharing ``model``'s device buffers (nothing is copied)."""
    mesh = model.mesh
    if data_axis not in mesh.shape:
        return [model]
    where = mesh.axis_names.index(data_axis)
    names = tuple(a for a in mesh.axis_names if a != data_axis)
    types = tuple(t for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                  if a != data_axis)  # fmt: skip
    graphdef, state = nnx.split(model.shard)
    replicas = []
    for i in range(mesh.shape[data_axis]):
        sub = Mesh(np.take(mesh.devices, i, axis=where), names, axis_types=types)
        devices = set(sub.devices.flat)

        def on_sub(x, sub=sub, devices=devices):
            sharding = NamedSharding(sub, x.sharding.spec)
            shards = [s.data for s in x.addressable_shards if s.device in devices]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

        replicas.append(
            TensorParallelModel(nnx.merge(graphdef, jax.tree.map(on_sub, state)), model.layout, sub)
        )
    return replicas


def cache_shardings(model: TensorParallelModel, cache_like: Any) -> Any:
    """NamedShardings of a pool pytree (arrays or shapes) for ``model``'s mesh."""
    return jax.tree.map(lambda s: NamedSharding(model.mesh, s), model.cache_specs(cache_like),
                        is_leaf=lambda s: isinstance(s, P))  # fmt: skip


def create_cache(
    model: TensorParallelModel, num_pages: int, page_size: int, dtype: Any,
    create: Callable[..., Any] = PagedKVCache.create, num_layers: int | None = None,
) -> Any:  # fmt: skip
    """A zero pool ``[L, size * K_local, P, C, H]`` built in place on the devices (each
    device allocates its own KV heads only); ``num_layers``: the pool's L (default the
    model's; a pool of two page groups has L / 2, `jpaged.kv.page_groups`).

    ``create(L, K, P, C, H, dtype)`` builds the pool pytree (default `PagedKVCache.create`).
    """
    L = model.num_layers if num_layers is None else num_layers
    args = (L, model.num_kv_heads, num_pages, page_size, model.head_dim, dtype)
    shardings = cache_shardings(model, jax.eval_shape(lambda: create(*args)))
    return jax.jit(lambda: create(*args), out_shardings=shardings)()
