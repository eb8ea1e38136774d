"""The tensor-parallel layout and the engine's mesh options, on one device.

Which device holds which heads, MLP columns and vocabulary rows; that each device's block of
every parameter is the parameter of the one-device model with the local config; the
PartitionSpecs; clear errors for meshes and sizes that cannot work. The many-device runs
are in ``mesh_cases.py`` (through ``test_parallel_mesh.py``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jpaged
from jpaged import models
from jpaged.engine.options import EngineOptions
from jpaged.parallel import TensorParallelLayout, make_mesh, shard_model
from jpaged.parallel.tp import _module_reader


def _indices(config, size, kind):
    return TensorParallelLayout(config, size).indices(kind).tolist()


def test_heads_split_or_copied():
    c = models.tiny(num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=300)
    assert _indices(c, 2, "q") == [[0, 1], [2, 3]]
    assert _indices(c, 2, "kv") == [[0], [1]]
    assert _indices(c, 4, "q") == [[0], [1], [2], [3]]
    assert _indices(c, 4, "kv") == [[0], [0], [1], [1]]  # K=2 < 4 devices: copies
    assert _indices(c, 8, "q") == [[0], [0], [1], [1], [2], [2], [3], [3]]  # N=4 < 8
    assert _indices(c, 8, "kv") == [[0], [0], [0], [0], [1], [1], [1], [1]]
    assert TensorParallelLayout(c, 8).output_scale().tolist() == [1, 0] * 4
    assert TensorParallelLayout(c, 4).output_scale().tolist() == [1] * 4
    # F=96 and V=300 over 8: blocks of 12 and 38, the vocabulary's last block padded.
    assert _indices(c, 8, "ffn")[-1] == list(range(84, 96))
    vocab = _indices(c, 8, "vocab")
    assert vocab[0] == list(range(38)) and vocab[-1] == [*range(266, 300), -1, -1, -1, -1]
    local = TensorParallelLayout(c, 8).local_config
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (
        1, 1, 12, 38,
    )  # fmt: skip
    assert TensorParallelLayout(c, 8).pool_kv_heads == 8
    assert TensorParallelLayout(c, 2).pool_kv_heads == 2


def test_partition_specs():
    layout = TensorParallelLayout(models.tiny(), 2)
    assert layout.param_spec("layers.wqkv_LDX", 3) == P(None, None, "model")
    assert layout.param_spec("layers.wo_LNHD", 4) == P(None, "model", None, None)
    assert layout.param_spec("layers.w_down_LFD", 3) == P(None, "model", None)
    assert layout.param_spec("layers.bqkv_LX", 2) == P(None, "model")
    assert layout.param_spec("embed_VD", 2) == P("model", None)
    assert layout.param_spec("lm_head_DV", 2) == P(None, "model")
    for replicated in ("norm_D", "layers.attn_norm_LD", "layers.bo_LD", "layers.b_down_LD"):
        assert layout.param_spec(replicated, 2) == P()


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_device_blocks_are_the_local_models_parameters(size):
    # Every bias on, odd sizes (F and V padded at 8): device d's block of each state array
    # equals that array in a one-device model built from d's slices of the parameters.
    c = models.tiny(num_heads=4, num_kv_heads=2, intermediate_size=20, vocab_size=37,
                    qkv_bias=True, o_bias=True, mlp_bias=True)  # fmt: skip
    model = models.LlamaForCausalLM(c, rngs=nnx.Rngs(3))
    full = dict(model.layers.unfused())
    full |= {"embed_VD": model.embed_VD[...], "norm_D": model.norm_D[...],
             "lm_head_DV": model.lm_head_DV[...]}  # fmt: skip
    layout = TensorParallelLayout(c, size)
    read = _module_reader(model)
    for d in range(size):
        sliced = {}
        for name, shape in models.param_shapes(layout.local_config).items():
            short = name.removeprefix("layers.")
            x = np.asarray(full[short])
            if short in ("wq_LDNH", "bq_LNH", "wk_LDKH", "wv_LDKH", "bk_LKH", "bv_LKH", "wo_LNHD",
                         "w_gate_LDF", "w_up_LDF", "b_gate_LF", "b_up_LF", "w_down_LFD",
                         "embed_VD", "lm_head_DV"):  # fmt: skip
                kind = {"q": "q", "k": "kv", "v": "kv", "o": "q"}.get(short[1], "ffn")
                kind = "vocab" if short in ("embed_VD", "lm_head_DV") else kind
                axis = {"wo_LNHD": 1, "w_down_LFD": 1, "embed_VD": 0}.get(short, len(shape) - 1)
                if short.startswith(("wq", "wk", "wv", "bq", "bk", "bv")):
                    axis = len(shape) - 2
                idx = layout.indices(kind)[d]
                x = np.take(x, np.maximum(idx, 0), axis=axis)
                mask = np.reshape(idx >= 0, [-1 if i == axis else 1 for i in range(x.ndim)])
                x = np.where(mask, x, 0)
                if short == "wo_LNHD":
                    x = x * layout.output_scale()[d]
            assert x.shape == shape, (name, x.shape, shape)
            sliced[name] = x
        local = models.LlamaForCausalLM(layout.local_config, params=sliced)
        _, state = nnx.split(local)
        for path, want in jax.tree_util.tree_flatten_with_path(state)[0]:
            name = ".".join(str(k.key) for k in path if getattr(k, "key", "value") != "value")
            layers = name.startswith("layers.")
            got = [layout.device_block(name, d, i if layers else None, read)
                   for i in (range(c.num_layers) if layers else [None])]  # fmt: skip
            got = np.stack(got) if layers else got[0]
            np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"{name} device {d}")


def test_layout_and_mesh_errors():
    with pytest.raises(ValueError, match=r"num_heads=6 must divide or be divisible by the "
                                         r"tensor parallel size 4"):  # fmt: skip
        TensorParallelLayout(models.tiny(num_heads=6, num_kv_heads=2), 4)
    with pytest.raises(ValueError, match=r"tensor parallel size=0 must be an int >= 1"):
        TensorParallelLayout(models.tiny(), 0)
    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"needs {2 * n} devices; there are {n}"):
        make_mesh(2 * n)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={2 * n}.*needs {2 * n} devices"):
        EngineOptions(tensor_parallel_size=2 * n)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be an int >= 1"):
        EngineOptions(tensor_parallel_size=0)
    bad = Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match=r"mesh axes \['x'\] are not engine axes"):
        EngineOptions(mesh=bad)
    with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh"):
        EngineOptions(mesh="model")
    one = make_mesh(1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must be 1 or the mesh's 'model'"):
        EngineOptions(mesh=one, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"has no axis 'model'"):
        models.from_pretrained("tests/checkpoints/llama2", mesh=bad)


def test_shard_model_rejects_other_models():
    class Other(nnx.Module):
        pass

    with pytest.raises(
        ValueError, match=r"splits jpaged.models.LlamaForCausalLM models; got Other"
    ):
        shard_model(Other(), make_mesh(1))


def test_one_device_mesh_runs_the_split_model():
    # TP = 1 through the split path: one device, the same greedy tokens as transformers.
    with open("tests/goldens/llama2.json") as f:
        g = json.load(f)
    llm = jpaged.LLM("tests/checkpoints/llama2", mesh=make_mesh(1), page_size=8, num_pages=64,
                     max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32)  # fmt: skip
    assert type(llm.model).__name__ == "TensorParallelModel"
    out = llm.generate([g["prompt_ids"]], jpaged.SamplingParams(max_tokens=32, temperature=0.0,
                                                                ignore_eos=True))  # fmt: skip
    assert out[0].outputs[0].token_ids == g["greedy"]["tokens"]
    assert dataclasses.replace(llm.options, mesh=None).engine_mesh() is None


@pytest.mark.parametrize("module", ["jpaged.parallel.layout", "jpaged.parallel.mesh",
                                    "jpaged.parallel.multihost"])  # fmt: skip
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0


def test_one_process_broadcast_is_the_object():
    from jpaged.parallel import broadcast_from_leader, is_leader

    obj = [("r0", [1, 2, 3], jpaged.SamplingParams(max_tokens=2))]
    assert is_leader() and broadcast_from_leader(obj) is obj
