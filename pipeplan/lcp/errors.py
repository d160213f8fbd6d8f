"""Errors of the LCP index: bad tensors, bad arguments, bad index files. The CLI maps them to exit code 2."""


class LCPError(ValueError):
    """Invalid input to the LCP index (shape, dtype, k, lengths) or an unreadable index file."""
