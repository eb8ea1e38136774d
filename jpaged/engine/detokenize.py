"""Incremental detokenization: the text of a growing token list, decoding a short window per
update instead of every token again (a streamed completion of n tokens costs O(n), not O(n^2)).

The window starts at the tokens emitted by the previous update (``prefix_offset``), so a
tokenizer that renders a token differently at the start of a string (SentencePiece's leading
space) still sees its left context; text is only emitted when the window's decode does not end
in an incomplete UTF-8 sequence (U+FFFD) and extends what was emitted. A finished sequence's text is
one full decode, so the final text equals ``tokenizer.decode(token_ids)`` exactly; with a
byte-fallback tokenizer and a model that emits invalid UTF-8 byte runs, that final decode can
render bytes already streamed as a valid character as U+FFFD instead.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """The decoded text of one sequence's output tokens, updated as tokens arrive.

    Attributes:
      text: the text emitted so far.
      prefix_offset: start of the decode window (tokens already emitted before it).
      read_offset: tokens emitted into ``text``.
      final: True once ``text`` is the full decode of a finished sequence.
    """

    __slots__ = ("final", "prefix_offset", "read_offset", "text")

    def __init__(self):
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.final = False

    def update(self, tokenizer: Any, ids: list[int], *, finished: bool = False) -> str:
        """The text of ``ids`` (which extend the ids of the previous update)."""
        if self.final:
            return self.text
        if finished:
            self.text, self.final = tokenizer.decode(ids), True
            self.prefix_offset = self.read_offset = len(ids)
            return self.text
        if len(ids) <= self.read_offset:
            return self.text
        before = tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        window = tokenizer.decode(ids[self.prefix_offset :])
        # Emit only an extension of what the window rendered before: a byte-fallback decoder
        # renders a whole run of byte tokens as U+FFFD once a later byte makes it invalid
        # UTF-8, which would rewrite text already sent (held back until the window moves on).
        if (
            len(window) > len(before)
            and window.startswith(before)
            and not window.endswith(_INCOMPLETE)
        ):
            self.text += window[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text
