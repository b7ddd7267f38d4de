"""Small helpers shared by every package (at the bottom of the import graph: imports nothing of the
project; torch only inside the function that needs it)."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers (b > 0): e.g. the pages that hold `a` tokens of `b` per page."""
    return -(-a // b)


_SM_COUNTS: dict[int, int] = {}


def sm_count(device) -> int:
    """The streaming multiprocessors of a CUDA device (cached per device), which kernel launches size
    their grids against; off CUDA (Triton's interpreter) an H200's 132, so CPU tests pick the grids
    the GPU would."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
