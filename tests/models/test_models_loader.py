"""Checkpoint loading, configs and tokenizer: errors with matched messages, dtype casts."""

from __future__ import annotations

import doctest
import json
import math
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerances import assert_close
from safetensors.numpy import load_file, save_file

from jpaged import models
from jpaged.models import _loader, _rope

ROOT = pathlib.Path(__file__).parents[1]
CKPT = ROOT / "checkpoints"


def _copy_checkpoint(tmp_path: pathlib.Path, name: str = "llama2") -> pathlib.Path:
    dst = tmp_path / name
    shutil.copytree(CKPT / name, dst)
    return dst


def _edit_config(ckpt: pathlib.Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def test_configs_from_checkpoints():
    llama2, llama3, mistral, qwen2 = (models.load_config(CKPT / n) for n in
                                      ("llama2", "llama3", "mistral", "qwen2"))  # fmt: skip
    assert (llama2.num_heads, llama2.num_kv_heads, llama2.head_dim) == (4, 2, 16)
    assert not llama2.tie_word_embeddings and llama2.rope_scaling is None
    assert llama3.tie_word_embeddings
    assert llama3.rope_scaling == models.RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )  # fmt: skip
    assert llama3.rope_theta == 500000.0
    assert mistral.sliding_window == 8 and mistral.num_kv_heads == 1
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    assert llama2.layer_windows == (None, None) and mistral.layer_windows == (8, 8)
    assert llama2.hidden_act == "silu" and llama2.sm_scale == 16**-0.5


def test_gemma2_config_from_checkpoint():
    gemma = models.load_config(CKPT / "gemma2")
    assert gemma.model_type == "gemma2" and gemma.tie_word_embeddings
    assert gemma.layer_types == ("sliding_attention", "full_attention") * 2
    assert gemma.layer_windows == (8, None, 8, None) and gemma.layer_period == 2
    assert (gemma.num_heads, gemma.num_kv_heads, gemma.head_dim) == (2, 1, 256)
    assert gemma.sm_scale == 64**-0.5  # query_pre_attn_scalar, not the head dim
    assert (gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (5.0, 10.0)
    assert gemma.post_norms and gemma.norm_unit_offset and gemma.scale_embeddings
    assert gemma.hidden_act == "gelu_pytorch_tanh"
    names = set(models.param_shapes(gemma))
    assert {"layers.post_attn_norm_LD", "layers.post_mlp_norm_LD"} <= names
    assert "lm_head_DV" not in names
    # Without layer_types Gemma2Config alternates sliding and full layers, sliding first.
    hf = json.loads((CKPT / "gemma2" / "config.json").read_text())
    del hf["layer_types"]
    assert models.ModelConfig.from_hf(hf).layer_windows == (8, None, 8, None)


@pytest.mark.parametrize(
    ("pattern", "period"),
    [((8, 8, 8, 8, 8, 8), 1), ((8, None) * 3, 2), ((4, 4, None) * 2, 3),
     ((4, None, None, None, 4, 4), 6)],
)  # fmt: skip
def test_layer_period(pattern, period):
    types = tuple("full_attention" if w is None else "sliding_attention" for w in pattern)
    config = models.tiny(num_layers=6, sliding_window=4, layer_types=types)
    assert config.layer_period == period
    assert config.layer_windows == tuple(None if w is None else 4 for w in pattern)


def test_benchmark_shapes_have_the_real_parameter_counts():
    count = lambda c: sum(math.prod(s) for s in models.param_shapes(c).values())  # noqa: E731
    assert count(models.llama3_8b()) == 8_030_261_248  # Meta-Llama-3-8B
    assert count(models.llama3_2_1b()) == 1_235_814_400  # Llama-3.2-1B (tied)


def test_sharded_checkpoint_loads_every_shard():
    assert len(list((CKPT / "qwen2").glob("model-*.safetensors"))) > 1
    model = models.from_pretrained(CKPT / "qwen2")
    bias = np.asarray(model.layers.unfused()["bq_LNH"])
    assert bias.shape == (2, 4, 16) and np.all(bias != 0)


def test_dtype_cast_on_load():
    model = models.from_pretrained(CKPT / "llama2", dtype=jnp.bfloat16)
    assert model.layers.unfused()["wq_LDNH"].dtype == jnp.bfloat16
    assert model.embed_VD[...].dtype == jnp.bfloat16
    golden = json.loads((ROOT / "goldens" / "llama2.json").read_text())
    logits = model.forward_dense(jnp.asarray([golden["prompt_ids"]], jnp.int32))[0]
    assert logits.dtype == jnp.float32
    # bf16 weights and activations through 2 layers vs transformers' f32: measured max
    # error 0.076 at |logits| <= 5, i.e. 3.6x the bf16 table entry.
    assert_close(logits, np.array(golden["prefill_logits"]), jnp.bfloat16, scale=5.0)


def test_unsupported_model_type(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_config(ckpt, model_type="gpt2")
    with pytest.raises(ValueError, match=r"unsupported model_type='gpt2'.*supports \('llama'"):
        models.from_pretrained(ckpt)


def test_unsupported_rope_type_and_activation(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"unsupported rope_type='yarn'"):
        models.load_config(ckpt)
    _edit_config(ckpt, rope_parameters={"rope_type": "default"}, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"unsupported hidden_act='gelu'.*'gelu_pytorch_tanh'"):
        models.load_config(ckpt)


def test_mixed_sliding_window_layers(tmp_path):
    ckpt = _copy_checkpoint(tmp_path, "qwen2")
    _edit_config(ckpt, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    config = models.load_config(ckpt)
    assert config.layer_windows == (4, None) and config.layer_period == 2
    _edit_config(ckpt, layer_types=["sliding_attention", "sliding_attention"])
    config = models.load_config(ckpt)
    assert config.sliding_window == 4 and config.layer_types is None
    assert config.layer_windows == (4, 4) and config.layer_period == 1
    _edit_config(ckpt, layer_types=["full_attention", "full_attention"])
    assert models.load_config(ckpt).layer_windows == (None, None)


def test_missing_and_unexpected_tensors(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    up = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing 1 tensor\(s\) that model_type='llama' needs: "
        r"\['model\.layers\.1\.mlp\.up_proj\.weight'\]",
    ):
        models.from_pretrained(ckpt)
    tensors["model.layers.1.mlp.up_proj.weight"] = up
    tensors["model.layers.0.mlp.extra.weight"] = up
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 tensor\(s\) that model_type='llama' does not use"):
        models.from_pretrained(ckpt)


def test_wrong_tensor_shape(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    _edit_config(ckpt, intermediate_size=64)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has"):
        models.from_pretrained(ckpt)
    _edit_config(ckpt, intermediate_size=96, head_dim=8)
    with pytest.raises(
        ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.\w_proj\.weight' has"
    ):
        models.from_pretrained(ckpt)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"local paths only"):
        models.from_pretrained(tmp_path / "nope")
    ckpt = _copy_checkpoint(tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        models.from_pretrained(ckpt)


def test_tokenizer():
    golden = json.loads((ROOT / "goldens" / "llama2.json").read_text())
    tok = models.load_tokenizer(CKPT / "llama2")
    assert tok.encode(golden["prompt_text"]).ids == golden["prompt_ids"]
    assert tok.decode(golden["prompt_ids"]) == golden["prompt_text"]
    assert models.load_tokenizer(CKPT / "llama3") is None


def test_config_validation():
    with pytest.raises(ValueError, match=r"num_heads=6 must be divisible by num_kv_heads=4"):
        models.tiny(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"hidden_size=0 must be a positive int"):
        models.tiny(hidden_size=0)
    with pytest.raises(ValueError, match=r"pass exactly one of rngs="):
        models.LlamaForCausalLM(models.tiny())
    with pytest.raises(
        ValueError, match=r"layer_types=\['full_attention'\] must hold num_layers=2"
    ):
        models.tiny(layer_types=("full_attention",))
    with pytest.raises(ValueError, match=r"layer_types=\['full_attention', 'local'\] must hold"):
        models.tiny(layer_types=("full_attention", "local"))
    with pytest.raises(ValueError, match=r"sliding_attention layers but sliding_window=None"):
        models.tiny(layer_types=("full_attention", "sliding_attention"))
    with pytest.raises(ValueError, match=r"hidden_act='relu' must be one of \('silu', 'gelu"):
        models.tiny(hidden_act="relu")
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=0.0 must be None or a number"):
        models.tiny(attn_logit_softcapping=0.0)
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar=True must be None or a number"):
        models.tiny(query_pre_attn_scalar=True)
    shapes = models.param_shapes(models.tiny())
    params = {k: jnp.zeros(s) for k, s in shapes.items() if k != "norm_D"}
    with pytest.raises(ValueError, match=r"missing parameters \['norm_D'\]"):
        models.LlamaForCausalLM(models.tiny(), params=params)


def test_init_random_on_device():
    model = models.init_random(models.tiny(tie_word_embeddings=True), seed=3, dtype=jnp.bfloat16)
    assert model.lm_head_DV is None
    w = model.layers.unfused()["w_up_LDF"]
    assert w.dtype == jnp.bfloat16 and w.shape == (2, 64, 128)
    assert 0.015 < float(jnp.std(w.astype(jnp.float32))) < 0.025
    logits = model.forward_dense(jnp.zeros((1, 3), jnp.int32))
    assert logits.shape == (1, 3, 256) and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("module", [_rope, _loader])
def test_doctests(module, monkeypatch):
    monkeypatch.chdir(ROOT.parent)  # the examples use repo-relative checkpoint paths
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_transformers_4_config_keys():
    """transformers 4.x writes `rope_theta` + `rope_scaling` (Llama 3.1 / linear style)."""
    base = json.loads((CKPT / "llama2" / "config.json").read_text())
    del base["rope_parameters"]
    llama31 = models.ModelConfig.from_hf(base | {
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    })  # fmt: skip
    assert llama31.rope_theta == 500000.0 and llama31.rope_scaling.rope_type == "llama3"
    assert llama31.rope_scaling.original_max_position_embeddings == 8192
    linear = models.ModelConfig.from_hf(base | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_theta == 10000.0 and linear.rope_scaling.factor == 2.0
    inv = _rope.inverse_frequencies(16, 10000.0, linear.rope_scaling)
    np.testing.assert_allclose(inv, _rope.inverse_frequencies(16, 10000.0) / 2, rtol=1e-7)
    plain = models.ModelConfig.from_hf(base | {"rope_scaling": None})
    assert plain.rope_scaling is None


def test_fused_layers_from_host_and_device_params_agree():
    """q/k/v and gate/up are stored fused; host (NumPy) params are fused on the host (a
    checkpoint never sits on the device twice), device ones on the device: same model."""
    cfg = models.tiny(qkv_bias=True, mlp_bias=True)
    shapes = models.param_shapes(cfg)
    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    a = models.LlamaForCausalLM(cfg, params=host)
    b = models.LlamaForCausalLM(cfg, params={k: jnp.asarray(v) for k, v in host.items()})
    assert isinstance(a.layers.wqkv_LDX[...], jax.Array)
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert a.layers.wqkv_LDX[...].shape == (cfg.num_layers, cfg.hidden_size, (N + 2 * K) * H)
    for model in (a, b):
        views = model.layers.unfused()
        assert set(views) == {k.removeprefix("layers.") for k in shapes if k.startswith("layers.")}
        for name, view in views.items():
            np.testing.assert_array_equal(np.asarray(view), host["layers." + name])
