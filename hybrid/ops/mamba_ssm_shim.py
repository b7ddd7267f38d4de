"""Import mamba-ssm's Triton kernels without running `mamba_ssm/__init__.py`.

The package `__init__` imports the Mamba1 CUDA extension (`selective_scan_cuda`), which is not
built in a Triton-only install; the Triton submodules we use do not need it. We register a bare
package module whose `__path__` is the installed folder, then import the submodules as usual.
Only ever imported on CUDA (hybrid.ops.mamba_cuda), never at CPU import time.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def _bare_package(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed (pip install 'hybrid[gpu]')")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module


def mamba_ssm_triton():
    """(mamba_chunk_scan_combined, selective_state_update) from mamba-ssm's Triton ops."""
    _bare_package("mamba_ssm")
    ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    ssu = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    return ssd.mamba_chunk_scan_combined, ssu.selective_state_update
