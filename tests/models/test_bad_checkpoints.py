"""Broken checkpoint directories: every error names the file (and the key) at fault, from
``load_config`` / ``load_tokenizer`` / ``from_pretrained`` and from ``jpaged.LLM(path)``."""

import json
import re
import shutil

import pytest

import jpaged
from jpaged.models import from_pretrained, load_config, load_tokenizer

CKPT = "tests/checkpoints/llama2"
LLAMA3 = "tests/checkpoints/llama3"


def _copy(tmp_path, src=CKPT):
    """A copy of a test checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst, copy_function=shutil.copy)
    return dst


def _edit_config(ckpt, edit):
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _names(path, *, what=None):
    """A regex naming the file (and ``what``)."""
    out = re.escape(repr(str(path)))
    return out if what is None else out + ".*" + what


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"model_type": "llama", ', r"is not valid JSON"),
        ("", r"is not valid JSON"),
        ('[{"model_type": "llama"}]', r"must hold a JSON object, got a list"),
    ],
)
def test_a_corrupt_config_json_is_named(tmp_path, text, match):
    ckpt = _copy(tmp_path)
    (ckpt / "config.json").write_text(text)
    for load in (load_config, from_pretrained, lambda p: jpaged.LLM(p, num_pages=8)):
        with pytest.raises(ValueError, match=_names(ckpt / "config.json", what=match)):
            load(ckpt)


def test_a_config_json_that_is_not_utf8_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(ValueError, match=_names(ckpt / "config.json", what="not valid JSON")):
        load_config(ckpt)


@pytest.mark.parametrize(
    "key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
)
def test_a_missing_required_key_is_named_with_the_file(tmp_path, key):
    ckpt = _copy(tmp_path)
    _edit_config(ckpt, lambda c: c.pop(key))
    with pytest.raises(ValueError, match=_names(ckpt / "config.json", what=f"no '{key}'")):
        load_config(ckpt)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("vocab_size", "300", r"vocab_size='300' must be an integer"),
        ("vocab_size", 300.5, r"vocab_size=300\.5 must be an integer"),
        ("num_hidden_layers", True, r"num_hidden_layers=True must be an integer"),
        ("vocab_size", 0, r"vocab_size=0 must be a positive int"),
        ("rms_norm_eps", "tiny", r"rms_norm_eps='tiny' must be a number"),
        ("max_position_embeddings", [128], r"max_position_embeddings=\[128\] must be an integer"),
        ("rope_parameters", "default", r"rope parameters 'default' must be a JSON object"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_named(tmp_path, key, value, match):
    ckpt = _copy(tmp_path)
    _edit_config(ckpt, lambda c: c.__setitem__(key, value))
    with pytest.raises(ValueError, match=_names(ckpt / "config.json", what=match)):
        load_config(ckpt)


def test_a_missing_rope_scaling_key_is_named(tmp_path):
    ckpt = _copy(tmp_path, LLAMA3)
    scaling = (
        "rope_parameters"
        if "rope_parameters" in (ckpt / "config.json").read_text()
        else ("rope_scaling")
    )
    _edit_config(ckpt, lambda c: c[scaling].pop("low_freq_factor"))
    with pytest.raises(ValueError, match=_names(ckpt / "config.json", what="no 'low_freq_factor'")):
        load_config(ckpt)


def test_a_corrupt_tokenizer_json_is_named(tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    match = _names(ckpt / "tokenizer.json", what="is not a valid tokenizer file")
    with pytest.raises(ValueError, match=match):
        load_tokenizer(ckpt)
    with pytest.raises(ValueError, match=match):
        jpaged.LLM(ckpt, num_pages=8, max_model_len=32)


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"eos_token_id": ', r"is not valid JSON"),
        ('{"eos_token_id": "two"}', r"eos_token_id='two' must be an int or a list of ints"),
        ('{"eos_token_id": [2, 2.5]}', r"eos_token_id=\[2, 2\.5\] must be an int or a list"),
    ],
)
def test_a_corrupt_generation_config_is_named(tmp_path, text, match):
    ckpt = _copy(tmp_path)
    (ckpt / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=_names(ckpt / "generation_config.json", what=match)):
        jpaged.LLM(ckpt, num_pages=8, max_model_len=32)
    # An explicit eos_token_id does not read the file.
    llm = jpaged.LLM(ckpt, num_pages=8, max_model_len=32, eos_token_id=2)
    assert llm.eos_token_ids == frozenset({2})


def test_a_valid_checkpoint_still_loads_its_eos_list(tmp_path):
    ckpt = _copy(tmp_path)
    (ckpt / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    assert jpaged.LLM(ckpt, num_pages=8, max_model_len=32).eos_token_ids == frozenset({2, 5})
