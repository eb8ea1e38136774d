"""The engine's step inputs: shape buckets, padding and the fixed-shape batches.

Every varying quantity of a step is an array and every shape comes from a small set of
buckets (tokens T, sequences and logits rows B, stop ids S, page pairs M), so after warm-up
the jitted programs (`jpaged.engine.runner`) compile nothing. Everything here is host NumPy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jpaged.engine.logits_process import LogitsInputs
from jpaged.engine.requests import Request, Sequence
from jpaged.kv.page_groups import PageGroups
from jpaged.models._protocol import AttentionMetadata

__all__ = [
    "LoopBatch",
    "SamplingArrays",
    "StepBatch",
    "bucket",
    "build_step_batch",
    "group_step_inputs",
    "loop_tables",
    "pad_to",
    "sampling_arrays",
    "sampling_row",
    "table_array",
]


def bucket(n: int, minimum: int, maximum: int) -> int:
    """The smallest power-of-two multiple of ``minimum`` that is >= n, capped at ``maximum``
    (n itself when n > ``maximum``: a shape is never smaller than its contents).

    >>> bucket(5, 4, 64), bucket(1, 4, 64), bucket(40, 4, 48), bucket(100, 4, 64)
    (8, 4, 48, 100)
    """
    b = minimum
    while b < n and b < maximum:
        b *= 2
    return min(b, maximum) if n <= maximum else n


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingArrays:
    """Per-row sampling parameters (R rows).

    Attributes:
      temperature: f32[R]; 0 is greedy.
      top_k: i32[R]; <= 0 keeps all tokens.
      top_p: f32[R].
      seed: i32[R].
      position: i32[R] position of the token each row samples.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    position: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBatch:
    """Inputs of one ragged step (host NumPy or device arrays, padded to buckets).

    Attributes:
      tokens: i32[T] input tokens; padding rows 0.
      positions: i32[T] their positions.
      metadata: the ``AttentionMetadata`` (slots, block tables [B, W], kv lens, cu_q_lens,
        num_seqs, logits_indices [R]).
      sampling: ``SamplingArrays`` of the R logits rows.
      logits: the rows' ``LogitsInputs`` (penalties, bias, min-p, processors) or None.
      prompt_targets: i32[T] or None: for prompt log-probabilities, the token that follows
        each token row in its prompt (-1: none); the step then computes every row's logits.
    """

    tokens: Any
    positions: Any
    metadata: AttentionMetadata
    sampling: SamplingArrays
    logits: LogitsInputs | None = None
    prompt_targets: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopBatch:
    """Inputs of the multi-step decode loop over B sequences (padded to a bucket).

    Attributes:
      tokens: i32[B] the last token of each sequence (not yet in the cache).
      lens: i32[B] tokens already in the cache; the input token sits at position ``lens``.
      block_tables: i32[B, W], covering the slots reserved for every step of the loop (of
        the global group in a pool of two page groups).
      local_block_tables: i32[B, W] the local group's tables in a pool of two page groups
        (`jpaged.kv.page_groups`), else None.
      active: bool[B] rows that decode (padding rows False).
      live: bool[B] rows the host still serves: a row aborted while a chain of loops runs is
        still active in the device carry, and is masked out here (host array, so the mask
        is part of the loop program: no separate device op, no compile mid-serving).
      max_steps: i32[B] tokens each row may still generate (length and ``max_tokens`` limits,
        within the reserved slots).
      min_steps: i32[B] tokens before which stop tokens do not stop a row (``min_tokens``).
      stop_ids: i32[B, S] stop tokens per row (EOS included unless ignored); -1 padding.
      sampling: ``SamplingArrays`` (``position`` unused: the loop computes it).
      logits: ``LogitsInputs`` or None; the loop appends each sampled token to its
        ``history`` (the carry holds it for the next loop).
    """

    tokens: Any
    lens: Any
    block_tables: Any
    local_block_tables: Any = None
    active: Any
    live: Any
    max_steps: Any
    min_steps: Any
    stop_ids: Any
    sampling: SamplingArrays
    logits: LogitsInputs | None = None


def pad_to(x: np.ndarray, n: int, fill) -> np.ndarray:
    """Pads the first axis of ``x`` to ``n`` rows with ``fill``."""
    x = np.asarray(x)
    if x.shape[0] >= n:
        return x[:n]
    pad = np.full((n - x.shape[0], *x.shape[1:]), fill, dtype=x.dtype)
    return np.concatenate([x, pad])


def table_array(tables: list[list[int]], num_rows: int, width: int) -> np.ndarray:
    """i32[num_rows, width] block tables of the given page-id lists (zeros past them)."""
    table_BW = np.zeros((num_rows, width), np.int32)
    for b, table in enumerate(tables):
        table_BW[b, : len(table)] = table[:width]
    return table_BW


def group_step_inputs(alloc: Any, runs: list[tuple[Any, int, int]]) -> dict[str, list]:
    """``build_step_batch``'s local-group arguments for sequences ``(seq_id, start, n)``
    of a pool of two page groups (`jpaged.kv.page_groups.PageGroups`); {} otherwise."""
    if not isinstance(alloc, PageGroups):
        return {}
    return {
        "local_slots": [alloc.local_slots(s, start, n) for s, start, n in runs],
        "local_tables": [alloc.local_block_table(s) for s, _, _ in runs],
    }


def loop_tables(alloc: Any, seq_ids: list[Any], num_rows: int, width: int) -> dict[str, Any]:
    """A `LoopBatch`'s table fields for ``seq_ids`` (None: a padding row): ``block_tables``
    i32[num_rows, W], and in a pool of two page groups ``local_block_tables``."""

    def tables(lookup):
        return table_array([[] if s is None else lookup(s) for s in seq_ids], num_rows, width)

    out = {"block_tables": tables(alloc.block_table)}
    if isinstance(alloc, PageGroups):
        out["local_block_tables"] = tables(alloc.local_block_table)
    return out


def build_step_batch(
    seqs: list[tuple[list[int], int, int]],
    slots: list[np.ndarray],
    tables: list[list[int]],
    row_seq: list[int],
    sampling: SamplingArrays,
    *,
    width: int,
    num_rows: int,
    num_tokens: int,
    local_slots: list[np.ndarray] | None = None,
    local_tables: list[list[int]] | None = None,
) -> StepBatch:
    """Packs B scheduled sequences into a padded ragged ``StepBatch`` (host NumPy).

    Args:
      seqs: per sequence ``(tokens, start, n)``: its tokens ``[start, start + n)`` run.
      slots: per sequence i32[n] cache slots of those tokens.
      tables: per sequence its page ids.
      row_seq: per logits row, the sequence whose last token's logits it samples from
        (several rows may share one: n > 1 completions of one prompt).
      sampling: the rows' ``SamplingArrays``, padded to ``num_rows``.
      width: W, block-table width.
      num_rows: the sequence/row bucket (>= B and >= len(row_seq)).
      num_tokens: the token bucket T (>= the total of the n's).
      local_slots: a pool of two page groups: per sequence the local group's slots (``slots``
        and ``tables`` are then the global group's); None otherwise.
      local_tables: with ``local_slots``, per sequence its local group's page ids.

    Returns:
      The batch; padding tokens have slot -1, padding sequences zero tokens and length.
    """
    toks, pos, cu = [], [], [0]
    for tokens, start, n in seqs:
        toks.extend(tokens[start : start + n])
        pos.extend(range(start, start + n))
        cu.append(cu[-1] + n)
    T = len(toks)
    local = {}
    if local_slots is not None:
        local = dict(
            local_slot_mapping=pad_to(np.concatenate(local_slots).astype(np.int32), num_tokens, -1),
            local_block_tables=table_array(local_tables, num_rows, width),
        )
    meta = AttentionMetadata(
        slot_mapping=pad_to(np.concatenate(slots).astype(np.int32), num_tokens, -1),
        block_tables=table_array(tables, num_rows, width),
        kv_lens=pad_to(np.asarray([s + n for _, s, n in seqs], np.int32), num_rows, 0),
        cu_q_lens=pad_to(np.asarray(cu, np.int32), num_rows + 1, T),
        num_seqs=np.int32(len(seqs)),
        logits_indices=pad_to(np.asarray([cu[b + 1] - 1 for b in row_seq], np.int32), num_rows, 0),
        **local,
    )
    return StepBatch(
        tokens=pad_to(np.asarray(toks, np.int32), num_tokens, 0),
        positions=pad_to(np.asarray(pos, np.int32), num_tokens, 0),
        metadata=meta,
        sampling=sampling,
    )


def sampling_row(req: Request, seq: Sequence, seed: int) -> tuple:
    """``(temperature, top_k, top_p, seed, position)`` of the row sampling ``seq``'s next
    token (beam search samples greedily: it reads the top log-probabilities instead)."""
    p = req.params
    if req.is_beam:
        return (0.0, 0, 1.0, 0, seq.num_tokens)
    return (p.temperature, p.top_k, p.top_p, seed, seq.num_tokens)


def sampling_arrays(samp: np.ndarray, R: int) -> SamplingArrays:
    """``SamplingArrays`` of ``sampling_row`` rows ``f64[n, 5]``, padded to ``R`` rows."""
    samp = np.asarray(samp, np.float64).reshape(-1, 5)
    return SamplingArrays(
        temperature=pad_to(samp[:, 0].astype(np.float32), R, 0.0),
        top_k=pad_to(samp[:, 1].astype(np.int32), R, 0),
        top_p=pad_to(samp[:, 2].astype(np.float32), R, 1.0),
        seed=pad_to(samp[:, 3].astype(np.int32), R, 0),
        position=pad_to(samp[:, 4].astype(np.int32), R, 0),
    )
