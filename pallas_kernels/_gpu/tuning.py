"""The entry of a GPU kernel's tuning table: a default, the rule that picks it, and the
measurement behind it (device, JAX version, date, commit). Each kernel's ``tuning_gpu`` module
holds its table (``TUNING``) beside the functions that apply the rules."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """Why a default is what it is.

    Attributes:
      knob: the option the rule sets (``num_stages``, ``swap_ab``, ...).
      rule: the default, in words (the function that applies it is named in ``TUNING``'s key).
      evidence: what was measured and what it gave.
      device: the GPU it was measured on.
      jax: the JAX version.
      date: the date of the measurement (ISO).
      commit: the commit that recorded it (``git show`` has the numbers and the command).
    """

    knob: str
    rule: str
    evidence: str
    device: str = "H200"
    jax: str = "0.11.2"
    date: str
    commit: str
