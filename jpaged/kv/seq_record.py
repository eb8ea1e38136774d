"""The allocator's record of one sequence: its pages (or host slots) and its length."""

from __future__ import annotations

import dataclasses

__all__ = ["RELEASED", "SeqRecord", "pages_for"]

# A block-table entry whose page went back to the pool: it held only positions no later query
# sees (outside the sliding window). Released entries are always the first ``released`` ones.
RELEASED = -1


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens, ``ceil(num_tokens / page_size)``.

    >>> pages_for(0, 4), pages_for(4, 4), pages_for(5, 4)
    (0, 1, 2)
    """
    return -(-num_tokens // page_size)


@dataclasses.dataclass
class SeqRecord:
    """One sequence as the allocator sees it.

    Attributes:
      pages: device page ids (reserved lookahead pages included), or host slots while
        swapped out; the first ``released`` entries are ``RELEASED``.
      num_tokens: the sequence's length (reserved slots not counted).
      hashes: prefix-cache hashes of its first full pages.
      salt: the prefix-cache salt it was allocated with.
      swapped: True while its pages live in the host swap space.
      released: leading pages given back to the pool (outside the sliding window).
    """

    pages: list[int]
    num_tokens: int
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    salt: bytes | str | None = None
    swapped: bool = False
    released: int = 0

    @property
    def held(self) -> list[int]:
        """The pages (or host slots) the sequence holds: ``pages`` past the released ones."""
        return self.pages[self.released :]
