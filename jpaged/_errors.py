"""Named exceptions of jpaged."""


class OutOfPagesError(RuntimeError):
    """The KV pool has too few free pages for a request. The message gives the numbers."""


class AllocatorError(ValueError):
    """Misuse of the block allocator: unknown sequence, double free, duplicate id."""
