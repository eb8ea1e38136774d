"""Chat templates: a checkpoint's Jinja template rendered as transformers'
``apply_chat_template`` renders it.

The template comes from the tokenizer object given to ``jpaged.LLM`` (a transformers
tokenizer's ``chat_template``) or from the checkpoint directory (``chat_template.jinja``,
else ``tokenizer_config.json``'s ``chat_template``). It is rendered in a sandboxed Jinja
environment set up as transformers sets it up (``trim_blocks``, ``lstrip_blocks``, loop
controls, a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``),
with the messages, ``add_generation_prompt`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...); the text is then tokenized without adding special
tokens (the template writes them).
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTemplate", "load_chat_template", "render_conversations"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
            "mask_token")  # fmt: skip


class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Args:
      template: the Jinja source.
      special_tokens: ``{"bos_token": "<s>", ...}``.
      source: where it was read from (for error messages).
    """

    def __init__(self, template: str, special_tokens: Mapping[str, str], source: str):
        self.template = template
        self.special_tokens = dict(special_tokens)
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs) -> str:  # fmt: skip
        """The conversation as the prompt text."""
        return _compile(self.template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _token_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]  # older tokenizer_config.json: an AddedToken dict
    return None


def load_chat_template(
    path: str | pathlib.Path | None, tokenizer: Any = None
) -> ChatTemplate | None:
    """The chat template of a tokenizer object (``tokenizer.chat_template``), else of the
    checkpoint at ``path``; None when neither has one.

    Raises:
      ValueError: ``tokenizer_config.json`` is not valid JSON (named in the message).
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return ChatTemplate(template, getattr(tokenizer, "special_tokens", {}), "the tokenizer")
    if path is None:
        return None
    path = pathlib.Path(path)
    config: dict = {}
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
    special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), special, str(jinja_file))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        return ChatTemplate(template, special, str(cfg_file))
    return None


def render_conversations(template: ChatTemplate | None, messages, *, add_generation_prompt: bool,
                         chat_template: str | None = None, **kwargs) -> list[str]:  # fmt: skip
    """Prompt texts of one conversation (a list of ``{"role", "content"}`` dicts) or of a list
    of them.

    Args:
      template: the engine's template (None: the checkpoint has none).
      chat_template: a template source that overrides it.

    Raises:
      ValueError: no template, or messages that are not conversations of such dicts.
    """
    if chat_template is not None:
        special = template.special_tokens if template is not None else {}
        template = ChatTemplate(chat_template, special, "chat_template=")
    if template is None:
        raise ValueError(
            "this model has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json, none on the tokenizer): pass chat_template= (a Jinja "
            "string) or use generate() with a prompt"
        )
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages={messages!r} must be a list of {{'role', 'content'}} dicts, "
                         "or a list of such lists")  # fmt: skip
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for conv in conversations:
        if (
            isinstance(conv, str | Mapping)
            or not isinstance(conv, Sequence)
            or not all(isinstance(m, Mapping) and "role" in m for m in conv)
        ):
            raise ValueError(f"conversation {conv!r} must be a list of dicts with a 'role' "
                             "(and usually a 'content')")  # fmt: skip
    return [template.render(conv, add_generation_prompt=add_generation_prompt, **kwargs)
            for conv in conversations]  # fmt: skip
