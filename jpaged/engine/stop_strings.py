"""Stop strings: where a sequence's output text first contains one, and how much of a
streamed text to hold back (a tail that could still grow into one).

The engine appends a stop-string request's tokens one at a time and decodes them
incrementally (`jpaged.engine.detokenize.Detokenizer`); after each token it looks for a stop
string that ends in the text the token added (`find_stop`). The first one found finishes
the sequence: its tokens end with the token that completed the string (later tokens of a
decode loop are dropped) and its text ends just before the string. A streamed snapshot of
a running sequence leaves out the longest tail of its text that is a prefix of a stop string
(`held_back`), so a snapshot's text only grows and never shows part of a stop string.

>>> find_stop("Hello world. Bye", 9, ("\\n", ". "))
(11, '. ')
>>> held_back("Hello wor", ("world!",))
'Hello '
"""

from __future__ import annotations

from typing import Any

from jpaged.engine.detokenize import Detokenizer

__all__ = ["find_stop", "held_back", "scan"]


def find_stop(text: str, old_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string of ``text`` that ends after ``text[:old_len]`` (one found in
    the old text already was seen before): ``(start index, string)`` or None."""
    best = None
    for s in stops:
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def held_back(text: str, stops: tuple[str, ...]) -> str:
    """``text`` without its longest tail that is a proper prefix of some stop string."""
    cut = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), cut, -1):
            if text.endswith(s[:n]):
                cut = n
                break
    return text[: len(text) - cut] if cut else text


def scan(seq: Any, tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Decodes ``seq``'s output tokens incrementally (``seq.detokenizer``) and returns the
    stop string that the newest text completes, as ``find_stop`` does."""
    if seq.detokenizer is None:
        seq.detokenizer = Detokenizer()
    old = len(seq.detokenizer.text)
    text = seq.detokenizer.update(tokenizer, seq.output_ids)
    return find_stop(text, old, stops) if len(text) > old else None
