"""What the Mosaic GPU kernels (decode ``paged_attention.kernel_gpu`` and ragged
``ragged_paged_attention.kernel_gpu``) share: ``config`` (constants, the frozen config base and
the option checks every ``make_config`` runs), ``checks`` (``unsupported_reason``'s common
reasons), ``order`` (longest-first packed sort keys), ``pages`` (TMA page copies into an SMEM
ring), ``merge`` (the split-KV log-sum-exp merge) and ``tuning`` (the tuning tables' entry).
"""
