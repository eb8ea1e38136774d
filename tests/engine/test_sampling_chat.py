"""Tokenizers and chat: a transformers tokenizer object behind the engine's interface, a
clear error for anything else, and ``LLM.chat`` rendering the checkpoint's chat template as
transformers' ``apply_chat_template`` does (golden text and ids in
tests/goldens/llama2_sampling.json)."""

import json
import pathlib
import shutil

import jinja2
import pytest
import tokenizers
from _engine_helpers import CKPT, ENGINE

import jpaged
from jpaged.engine.tokenizer_adapter import TransformersTokenizer, as_engine_tokenizer

GOLDEN = json.loads(pathlib.Path("tests/goldens/llama2_sampling.json").read_text())
CHAT = GOLDEN["chat"]
ENGINE = {**ENGINE, "max_model_len": 128}  # the chat prompt is about 80 tokens
GREEDY = jpaged.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


class PreTrainedTokenizerBase:  # stands for transformers' base class (not installed here)
    pass


PreTrainedTokenizerBase.__module__ = "transformers.tokenization_utils_base"


class PreTrainedTokenizerFast(PreTrainedTokenizerBase):
    """transformers' interface: ``encode`` returns a list, ``decode`` keeps special tokens
    unless told otherwise, ``chat_template`` and ``special_tokens_map`` attributes."""

    def __init__(self, path, chat_template=None):
        self._tok = tokenizers.Tokenizer.from_file(str(pathlib.Path(path) / "tokenizer.json"))
        self.chat_template = chat_template
        self.special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

    def encode(self, text, add_special_tokens=True):
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens=False):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _checkpoint_copy(tmp_path, *, jinja=None, config_template=None):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CKPT, ckpt)
    if jinja is not None:
        (ckpt / "chat_template.jinja").write_text(jinja)
    if config_template is not None:
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
        cfg["chat_template"] = config_template
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ckpt


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_chat_renders_like_transformers(tmp_path, where):
    kw = {"jinja": CHAT["template"]} if where.endswith("jinja") else {
        "config_template": CHAT["template"]}  # fmt: skip
    llm = jpaged.LLM(_checkpoint_copy(tmp_path, **kw), **ENGINE)
    for add, key in ((True, "with_generation_prompt"), (False, "without_generation_prompt")):
        out = llm.chat(CHAT["messages"], GREEDY, add_generation_prompt=add)[0]
        assert out.prompt == CHAT[key]["text"]
        assert out.prompt_token_ids == CHAT[key]["token_ids"]
        assert len(out.outputs[0].token_ids) == 3
    # A list of conversations gives one output each, in order.
    outs = llm.chat([CHAT["messages"], CHAT["messages"][1:2]], GREEDY)
    assert outs[0].prompt == CHAT["with_generation_prompt"]["text"]
    assert outs[1].prompt == "<s>[USER] The quick brown fox\n[ASSISTANT] "
    with pytest.raises(jinja2.TemplateError, match="unknown role: tool"):
        llm.chat([{"role": "tool", "content": "x"}], GREEDY)
    with pytest.raises(ValueError, match=r"messages=.* must be a list of"):
        llm.chat("hello", GREEDY)
    with pytest.raises(ValueError, match="must be a list of dicts with a 'role'"):
        llm.chat([["hello"]], GREEDY)
    assert not llm.has_unfinished_requests()


def test_no_template_is_a_clear_error_and_chat_template_overrides():
    llm = jpaged.LLM(CKPT, **ENGINE)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="this model has no chat template"):
        llm.chat(msgs, GREEDY)
    out = llm.chat(msgs, GREEDY, chat_template="{% for m in messages %}<{{ m.content }}>"
                   "{% endfor %}{{ x }}", chat_template_kwargs={"x": "!"})[0]  # fmt: skip
    assert out.prompt == "<hi>!"
    assert out.prompt_token_ids == llm.tokenizer.encode("<hi>!", add_special_tokens=False).ids


def test_transformers_tokenizer_object_is_adapted(tmp_path):
    g = GOLDEN["tokenizer"]
    fake = PreTrainedTokenizerFast(CKPT, chat_template=CHAT["template"])
    adapted = as_engine_tokenizer(fake)
    assert isinstance(adapted, TransformersTokenizer) and adapted.tokenizer is fake
    # transformers' own encode / decode of the same tokenizer (golden): the same ids and text.
    assert adapted.encode(g["text"]).ids == g["encode"]
    assert adapted.decode(g["decode_ids"]) == g["decode"]
    llm = jpaged.LLM(CKPT, tokenizer=fake, **ENGINE)
    assert llm.tokenizer.tokenizer is fake
    out = llm.generate("The quick brown fox jumps", GREEDY)[0]
    ref = jpaged.LLM(CKPT, **ENGINE).generate("The quick brown fox jumps", GREEDY)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.outputs[0].text == ref.outputs[0].text
    # The tokenizer's template is used (the checkpoint has none).
    chat = llm.chat(CHAT["messages"], GREEDY)[0]
    assert chat.prompt == CHAT["with_generation_prompt"]["text"]
    assert chat.prompt_token_ids == CHAT["with_generation_prompt"]["token_ids"]


@pytest.mark.parametrize("bad", [123, "tokenizer.json", object()])
def test_other_tokenizers_are_refused(bad):
    with pytest.raises(ValueError, match=r"expected a tokenizers\.Tokenizer or a transformers"):
        jpaged.LLM(CKPT, tokenizer=bad, **ENGINE)


def test_chat_needs_a_tokenizer():
    from _engine_helpers import make_llm

    with pytest.raises(ValueError, match=r"chat\(\) needs a tokenizer"):
        make_llm().chat([{"role": "user", "content": "hi"}], GREEDY)
