"""The engine's tokenizer interface, and an adapter that puts a transformers tokenizer
behind it.

The engine calls ``encode(text, add_special_tokens=True).ids`` and
``decode(ids, skip_special_tokens=True)``: the interface of ``tokenizers.Tokenizer``, which it
uses as is. A transformers tokenizer (``PreTrainedTokenizerFast`` and the other
``PreTrainedTokenizerBase`` classes: ``encode`` returns a list, ``decode`` keeps special
tokens by default) is wrapped in `TransformersTokenizer`; anything else is refused with a
``ValueError`` naming what is accepted.

>>> as_engine_tokenizer(None) is None
True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tokenizers

__all__ = ["Encoding", "TransformersTokenizer", "as_engine_tokenizer", "is_transformers_tokenizer"]


@dataclasses.dataclass(frozen=True)
class Encoding:
    """The part of ``tokenizers.Encoding`` the engine reads."""

    ids: list[int]


def is_transformers_tokenizer(obj: Any) -> bool:
    """True for an instance of a transformers tokenizer class (``PreTrainedTokenizerBase``
    or a subclass), recognised without importing transformers."""
    return any(
        c.__name__ == "PreTrainedTokenizerBase" and c.__module__.startswith("transformers")
        for c in type(obj).__mro__
    )


class TransformersTokenizer:
    """A transformers tokenizer with ``tokenizers.Tokenizer``'s ``encode``/``decode``.

    Args:
      tokenizer: the transformers tokenizer (kept as ``tokenizer``).

    Attributes:
      tokenizer: the wrapped object.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return Encoding([int(t) for t in ids])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template (a string), if it has one."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: transformers uses "default"
            template = template.get("default")
        return template if isinstance(template, str) else None

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``... as the chat template sees them."""
        return {k: str(v) for k, v in dict(getattr(self.tokenizer, "special_tokens_map", {})).items()
                if isinstance(v, str)}  # fmt: skip

    def __repr__(self) -> str:
        return f"TransformersTokenizer({type(self.tokenizer).__name__})"


def as_engine_tokenizer(tokenizer: Any) -> tokenizers.Tokenizer | TransformersTokenizer | None:
    """The tokenizer as the engine uses it: a ``tokenizers.Tokenizer`` (or None) as is, a
    transformers tokenizer wrapped in `TransformersTokenizer`.

    Raises:
      ValueError: anything else.
    """
    if tokenizer is None or isinstance(tokenizer, tokenizers.Tokenizer | TransformersTokenizer):
        return tokenizer
    if is_transformers_tokenizer(tokenizer):
        return TransformersTokenizer(tokenizer)
    raise ValueError(
        f"tokenizer={type(tokenizer).__name__} object: expected a tokenizers.Tokenizer or a "
        "transformers tokenizer (PreTrainedTokenizerBase, e.g. PreTrainedTokenizerFast), or "
        "None to load the checkpoint's tokenizer.json"
    )
