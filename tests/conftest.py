"""Shared fixtures: tiny on-disk checkpoints (built once per session) and an LLM factory."""
from __future__ import annotations

import os
import sys

import pytest
import torch

# Without CUDA our Triton kernels are tested through Triton's CPU interpreter, which must be switched
# on before triton is first imported (tests/test_triton_kernels.py); the GPU tests are skipped then.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_checkpoints  # noqa: E402

# The tiny models are made of tiny ops: intra-op threading only adds synchronisation (16x slower
# on a loaded 2-core machine), and the cores are shared. One thread.
torch.set_num_threads(1)



def pytest_configure(config):
    # transformers falls back to reference torch kernels on CPU and says so on every load.
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - transformers is a test dependency
        pass


@pytest.fixture(autouse=True)
def kernel_switches_read_afresh():
    """Each test reads the kernel switches from its own environment: one that set a variable and failed before
    resetting them leaves no cached value to the tests after it."""
    yield
    from hybrid.ops import triton_guard

    triton_guard.reset_switches()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(name) -> directory of the named checkpoint, built once per session."""
    built: dict[str, str] = {}
    root = tmp_path_factory.mktemp("tiny_ckpts")

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(tiny_checkpoints.build(name, root / name))
        return built[name]

    return get


@pytest.fixture
def make_llm():
    """make_llm(path, **LLM kwargs) -> a fresh hybrid.LLM on CPU, fp32."""
    from hybrid import LLM

    def make(path, **kwargs) -> "LLM":
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        return LLM(str(path), **kwargs)

    return make


@pytest.fixture(scope="session")
def prompts_for(tiny_ckpt):
    """prompts_for(name) -> {length: prompt ids}: deterministic, well-conditioned prompts (see
    hf_oracle.select_prompts) of lengths 1, 5 (< chunk 8), 8 (= chunk), 17 (a 16-token budget
    leaves a 1-token tail) and 27 (several chunks)."""
    import hf_oracle

    cache: dict[str, dict[int, list[int]]] = {}

    def get(name: str) -> dict[int, list[int]]:
        if name not in cache:
            cache[name] = hf_oracle.select_prompts(tiny_ckpt(name))
        return cache[name]

    return get



def pytest_collection_modifyitems(config, items):
    """Bit-exact padding cases run only inside the child process that test_padded_decode_bit_identical
    starts (with ATen's scalar CPU kernels); in the normal run they are deselected, not skipped.
    HYBRID_SMOKE=1 keeps only the first parametrization of every test function: one device call then
    reaches every GPU test (bench/run_device.sh tests-smoke) before the full grid runs."""
    if os.environ.get("HYBRID_BITEXACT_CHILD") == "1":
        return
    keep = [item for item in items if item.get_closest_marker("bitexact_child") is None]
    if os.environ.get("HYBRID_SMOKE") == "1":
        seen: set[tuple[str, str]] = set()
        first = []
        for item in keep:
            key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
            if key not in seen:
                seen.add(key)
                first.append(item)
        keep = first
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
