"""Which layers of a model go to which page group: the pure layer-pattern rules behind
`jpaged.kv.page_groups` (the model's layer scan and the engine's pool sizing read them; they
import nothing of the host allocator).

A model mixing sliding-window (local) and full-attention (global) layers, as many of each in
every scan period of its layers (Gemma 2), keeps its pages in two groups: the pool's layer axis
holds one slice per layer of a group (``pool_layers``), and a layer indexes it by its place
within its group (``group_layer_indices``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["group_layer_indices", "local_window", "pool_layers"]


def local_window(layer_windows: Sequence[int | None] | None) -> int | None:
    """The window of the local group: the largest layer window when some layers have one
    and others none (a mixed model), else None.

    >>> local_window((8, None, 8, None)), local_window((8, 8)), local_window((None,))
    (8, None, None)
    """
    if not layer_windows:
        return None
    windows = [w for w in layer_windows if w is not None]
    if not windows or len(windows) == len(layer_windows):
        return None
    return max(windows)


def pool_layers(layer_windows: Sequence[int | None]) -> int | None:
    """Layer slices of a grouped pool: L / 2 when half the layers are windowed and each
    scan period of the layers holds as many local as global ones, else None (no groups).

    >>> pool_layers((8, None, 8, None)), pool_layers((8, 8, None)), pool_layers((8, 8))
    (2, None, None)
    """
    windows = tuple(layer_windows)
    L = len(windows)
    period = next(p for p in range(1, L + 1) if not L % p and windows == windows[:p] * (L // p))
    local = sum(w is not None for w in windows[:period])
    if local_window(layer_windows) is None or 2 * local != period:
        return None
    return L // 2


def group_layer_indices(layer_windows: Sequence[int | None]) -> tuple[int, ...]:
    """Each layer's index within its group (local layers and global layers counted apart):
    the layer slice of the grouped pool it reads and writes.

    >>> group_layer_indices((8, None, 8, None)), group_layer_indices((None, 4, 4, None))
    ((0, 0, 1, 1), (0, 0, 1, 1))
    """
    seen = {True: 0, False: 0}
    out = []
    for w in layer_windows:
        out.append(seen[w is None])
        seen[w is None] += 1
    return tuple(out)
