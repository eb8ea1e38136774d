"""The Gemma 2 forward on a pool of two page groups (`jpaged.kv.page_groups`): each layer
reads and writes its group's layer slice through its group's slots and tables, and the
logits equal those of the one-group pool."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jpaged
from jpaged import models

C = 4


def _grouped(md: models.AttentionMetadata, offset: int) -> models.AttentionMetadata:
    """``md`` on two groups: local pages are the global ones shifted by ``offset`` (the table
    layout is the same; the local group's pages hold other K/V)."""
    slots = np.asarray(md.slot_mapping)
    return dataclasses.replace(
        md,
        local_slot_mapping=np.where(slots >= 0, slots + offset * C, -1).astype(np.int32),
        local_block_tables=np.asarray(md.block_tables) + offset,
    )


def test_two_groups_give_the_one_group_logits():
    with open("tests/goldens/gemma2.json") as f:
        prompt = json.load(f)["prompt_ids"]
    model = models.from_pretrained("tests/checkpoints/gemma2")
    c = model.config
    P = 8
    table = [[3, 0, 6, 2, 5, 1]]  # a permuted table; pages 4 and 7 never written (NaN)

    def pool(layers, pages):
        shape = (layers, c.num_kv_heads, pages, C, c.head_dim)
        nan = jnp.full(shape, jnp.nan, jnp.float32)
        return jpaged.PagedKVCache(k_pages=nan, v_pages=jnp.full_like(nan, jnp.nan))

    one, two = pool(c.num_layers, P), pool(c.num_layers // 2, 2 * P)
    positions, md = models.batch_metadata(table, [0], [len(prompt) - 3], C)
    ref, one = model(jnp.asarray(prompt[:-3]), positions, one, md)
    got, two = model(jnp.asarray(prompt[:-3]), positions, two, _grouped(md, P))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # A chunk after the cached prefix, then a decode step: still equal.
    positions, md = models.batch_metadata(table, [len(prompt) - 3], [3], C)
    ref, one = model(jnp.asarray(prompt[-3:]), positions, one, md)
    got, two = model(jnp.asarray(prompt[-3:]), positions, two, _grouped(md, P))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    token = jnp.asarray([int(np.argmax(ref[0]))])
    positions, md = models.batch_metadata(table, [len(prompt)], [1], C)
    ref, _ = model(token, positions, one, md, decode=True)
    got, two = model(token, positions, two, _grouped(md, P), decode=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # The local layers wrote only local pages, the global layers only global ones.
    k = np.asarray(two.k_pages)
    assert np.isfinite(k[:, :, [3, 0, 6, 2, 5]]).all() and np.isfinite(k[:, :, [11, 8, 13]]).all()
    assert np.isnan(k[:, :, [4, 7, 12, 15]]).all()


def test_grouped_metadata_needs_a_mixed_model_and_half_the_slices():
    model = models.from_pretrained("tests/checkpoints/gemma2")
    c = model.config
    shape = (c.num_layers, c.num_kv_heads, 8, C, c.head_dim)
    cache = jpaged.PagedKVCache(k_pages=jnp.zeros(shape), v_pages=jnp.zeros(shape))
    positions, md = models.batch_metadata([[0, 1]], [0], [5], C)
    with pytest.raises(ValueError, match="pool of 2 layer slices; got layer windows"):
        model(jnp.arange(5), positions, cache, _grouped(md, 4))
