"""Warm-up: every step program an engine can meet, compiled on inputs that write nothing."""

from __future__ import annotations

import jax
import numpy as np

from jpaged.engine.batches import LoopBatch, bucket, build_step_batch, sampling_arrays
from jpaged.engine.kv_manager import KVManager
from jpaged.engine.runner import SAMPLING_MODES, Runner

__all__ = ["warmup_programs"]


def warmup_programs(
    kv: KVManager,
    runner: Runner,
    *,
    width: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_decode_steps: int,
    progress: bool = False,
) -> int:
    """Runs the decode step for every sequence bucket, the decode loop (when
    ``num_decode_steps > 1``) for every sequence bucket and sampling mode, the ragged step for
    every (sequence, token) bucket pair, and the page programs (`KVManager`); returns the
    number of program shapes run. Padding rows and slot -1 write nothing."""
    W = width
    top = max(max_num_batched_tokens, 16)
    seq_buckets = sorted({bucket(n, 8, max_num_seqs) for n in range(1, max_num_seqs + 1)})
    tok_buckets = sorted({bucket(t, 16, top) for t in range(1, top + 1)})
    shapes = [("decode", B, B) for B in seq_buckets]
    if num_decode_steps > 1:  # every sampling mode (a static argument)
        shapes += [("loop", B, m) for B in seq_buckets for m in SAMPLING_MODES]
    shapes += [("ragged", B, T) for B in seq_buckets for T in tok_buckets]
    if progress:
        from tqdm.auto import tqdm

        shapes_iter = tqdm(shapes, desc="warmup", unit="program")
    else:
        shapes_iter = shapes
    for kind, B, T in shapes_iter:
        zeros = np.zeros((B, 5))
        if kind == "loop":
            batch = LoopBatch(
                tokens=np.zeros(B, np.int32), lens=np.zeros(B, np.int32),
                block_tables=np.zeros((B, W), np.int32), active=np.zeros(B, bool),
                live=np.zeros(B, bool),
                max_steps=np.zeros(B, np.int32), min_steps=np.zeros(B, np.int32),
                stop_ids=np.full((B, 4), -1, np.int32), sampling=sampling_arrays(zeros, B),
            )  # fmt: skip
            kv.cache = runner.decode_loop(kv.cache, batch, num_steps=num_decode_steps, mode=T)[0]
            continue
        batch = build_step_batch(
            [], [np.zeros(0, np.int32)], [], [], sampling_arrays(zeros, B),
            width=W, num_rows=B, num_tokens=T,
        )  # fmt: skip
        kv.cache = runner.step(kv.cache, batch, decode=kind == "decode")[0]
    num = len(shapes) + kv.warmup_page_programs(width)
    jax.block_until_ready(kv.cache)
    return num
