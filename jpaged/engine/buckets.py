"""The shape buckets of the engine's step programs, and the programs a configuration needs.

Every shape a step program sees comes from a `BucketGrid`, so warm-up compiles a short,
known list of programs (`BucketGrid.programs`) and serving compiles nothing after it:

- rows (sequences of a decode step or a decode loop, logits rows of a ragged step): 16, 64,
  then doubling (128, 256, ...), the last one ``max_num_seqs``;
- tokens of a ragged step (prefill, chunked prefill, mixed): 64, then doubling, the last one
  ``max_num_batched_tokens``; a ragged step of T tokens has the row bucket of T (at most the
  largest), so one program serves each token bucket;
- stop ids per row of a decode loop: 8, then doubling.

Why these sizes (one H200, Llama-3 shapes, bf16; BENCHMARKS.md): a decode step or a
prefill of fewer than ~200 tokens reads every weight once and is bound by that read (the
GEMMs' arithmetic intensity is below the H200's ~206 FLOP/byte ridge), so padding 17 rows to
64, or 5 prompt tokens to 64, costs close to nothing, while each bucket costs a compile of
the whole model (seconds on a GPU). Padded rows carry zero K/V length and write nothing.
Past 64, rows and tokens double, so padding never more than doubles a step's work where it
is compute-bound.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MIN_ROWS", "MIN_STOPS", "MIN_TOKENS", "BucketGrid", "ProgramKey", "stop_bucket"]

MIN_ROWS = 16  # the smallest row bucket
ROWS_STEP = 64  # the second row bucket; from there on, buckets double
MIN_TOKENS = 64  # the smallest token bucket of a ragged step
MIN_STOPS = 8  # stop ids per row of a decode loop (EOS ids included)


def _doubling(first: int, top: int) -> tuple[int, ...]:
    """``first, 2 first, 4 first, ...`` below ``top``, then ``top`` itself.

    >>> _doubling(64, 300), _doubling(64, 64), _doubling(64, 32)
    ((64, 128, 256, 300), (64,), (32,))
    """
    out = []
    b = first
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def _smallest_at_least(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n; ``n`` itself past the largest (never smaller than the
    contents: such a shape compiles when first met)."""
    for b in buckets:
        if b >= n:
            return b
    return n


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """One step program of the grid.

    Attributes:
      kind: "decode" (one decode step of B rows), "loop" (a decode loop of B rows),
        "ragged" (a ragged step of T tokens and B rows), "join" (rows joining a decode
        loop's carry of B rows, their first tokens from a step of T rows) or "grow" (a
        decode loop's carry of T rows grown to B; `jpaged.engine.chain_join`).
      rows: B.
      tokens: T (B for "decode" and "loop").
      mode: the loop's static sampling mode ("greedy", "random", "truncate"), else None.
    """

    kind: str
    rows: int
    tokens: int
    mode: str | None = None

    @property
    def name(self) -> str:
        """A short label, e.g. ``"loop B=64 greedy"`` or ``"ragged T=256 B=256"``."""
        if self.kind == "ragged":
            return f"ragged T={self.tokens} B={self.rows}"
        if self.kind == "join":
            return f"join B={self.rows} R={self.tokens}"
        if self.kind == "grow":
            return f"grow B={self.tokens}->{self.rows}"
        return f"{self.kind} B={self.rows}" + (f" {self.mode}" if self.mode else "")


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    """The row and token buckets of one engine configuration.

    Args:
      max_num_seqs: most sequences in one step (the largest row bucket).
      max_num_batched_tokens: token budget of one step (the largest token bucket).

    >>> g = BucketGrid(max_num_seqs=256, max_num_batched_tokens=2048)
    >>> g.row_buckets, g.token_buckets
    ((16, 64, 128, 256), (64, 128, 256, 512, 1024, 2048))
    >>> g.rows(5), g.rows(65), g.ragged_shape(num_tokens=300, num_rows=3)
    (16, 128, (256, 512))

    Raises:
      ValueError: a size < 1.
    """

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """16, 64, then doubling; the last is ``max_num_seqs``."""
        top = self.max_num_seqs
        if top <= MIN_ROWS:
            return (top,)
        return (MIN_ROWS, *_doubling(ROWS_STEP, top))

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """64, then doubling; the last is ``max_num_batched_tokens``, or ``max_num_seqs`` when
        larger (a step's logits rows, n > 1 completions of a short prompt, may outnumber its
        tokens)."""
        return _doubling(MIN_TOKENS, max(self.max_num_batched_tokens, self.max_num_seqs))

    def rows(self, n: int) -> int:
        """The row bucket of ``n`` rows."""
        return _smallest_at_least(self.row_buckets, n)

    def ragged_shape(self, *, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """``(B, T)`` of a ragged step of ``num_tokens`` tokens and ``num_rows`` rows (its
        sequences, and its logits rows when more): T is the token bucket of
        ``max(num_tokens, num_rows)`` and B the row bucket of T, at most the largest one
        (both >= ``num_rows`` while it is within ``max_num_seqs``)."""
        T = _smallest_at_least(self.token_buckets, max(num_tokens, num_rows))
        return self._rows_of_tokens(T, num_rows), T

    def _rows_of_tokens(self, T: int, num_rows: int = 0) -> int:
        return max(min(self.rows(T), self.row_buckets[-1]), self.rows(num_rows))

    def programs(self, *, loops: bool, modes: tuple[str, ...],
                 join: bool = False) -> list[ProgramKey]:  # fmt: skip
        """Every step program this configuration can meet (beam search's top-k variant
        aside): with ``loops`` (decode chains) the decode loop per row bucket and sampling
        mode, and the single decode step per row bucket (beam search, a pool too short for
        a loop's lookahead); without, the single decode step only; and the ragged step per
        token bucket. With ``join`` (and loops), the programs that let rows join a running
        chain: a join per pair of row buckets (the carry's, the step's) and a grow per
        larger row bucket.

        >>> g = BucketGrid(max_num_seqs=64, max_num_batched_tokens=64)
        >>> [k.name for k in g.programs(loops=True, modes=("greedy",), join=True)]
        ... # doctest: +NORMALIZE_WHITESPACE
        ['decode B=16', 'decode B=64', 'loop B=16 greedy', 'loop B=64 greedy',
         'ragged T=64 B=64', 'join B=16 R=16', 'join B=16 R=64', 'join B=64 R=16',
         'join B=64 R=64', 'grow B=16->64']
        """
        rows = self.row_buckets
        keys = [ProgramKey("decode", B, B) for B in rows]
        if loops:
            keys += [ProgramKey("loop", B, B, m) for B in rows for m in modes]
        keys += [ProgramKey("ragged", self._rows_of_tokens(T), T) for T in self.token_buckets]
        if join and loops:
            keys += [ProgramKey("join", B, R) for B in rows for R in rows]
            keys += [ProgramKey("grow", B2, B1) for B1 in rows for B2 in rows if B2 > B1]
        return keys


def stop_bucket(n: int) -> int:
    """Stop-id columns of a decode loop whose rows have at most ``n`` stop ids.

    >>> stop_bucket(0), stop_bucket(3), stop_bucket(9)
    (8, 8, 16)
    """
    b = MIN_STOPS
    while b < n:
        b *= 2
    return b
