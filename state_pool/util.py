"""Small helpers shared by every package (at the bottom of the import graph: imports nothing)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0): e.g. the pages that hold `a` tokens of `b` per page."""
    return -(-a // b)
