"""The greedy kernels (hybrid/ops/triton_greedy.py) against torch.argmax and torch.isfinite, on CPU through
Triton's interpreter (see tests/test_triton_kernels.py for why the interpreter is switched on here only)."""
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: run in their own process with TRITON_INTERPRET=1", allow_module_level=True)

from hybrid.ops import triton_greedy  # noqa: E402


def _torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = logits.argmax(dim=-1)
    return tokens, torch.isfinite(logits.gather(1, tokens[:, None])[:, 0])


def _check(logits: torch.Tensor) -> None:
    tokens, finite = triton_greedy.greedy_tokens(logits)
    want_tokens, want_finite = _torch(logits.float())
    assert tokens.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(tokens, want_tokens), (tokens, want_tokens)
    assert torch.equal(finite, want_finite)


@pytest.mark.parametrize("V", [1, 7, 2048, 2049, 5000, 300000])
def test_random_rows_as_torch(V):
    """Ragged vocabularies (one element, a partial tile, exact and partial chunks, wide chunks past
    MAX_CHUNKS), several rows."""
    g = torch.Generator().manual_seed(V)
    _check(torch.randn(3, V, generator=g))


def test_ties_take_the_lowest_index_within_and_across_chunks():
    V = 3 * triton_greedy.CHUNK + 5
    x = torch.zeros(4, V)
    x[0, [5, 9]] = 3.0  # two in one tile
    x[1, [triton_greedy.CHUNK + 1, 2 * triton_greedy.CHUNK + 3]] = 3.0  # in two chunks
    x[2, [1030, 1500]] = 2.0  # in two tiles of one chunk
    x[3, -1] = 1.0  # in the last, partial chunk
    _check(x)


def test_nan_and_infinities_as_torch():
    """A NaN is the maximum (the first one wins), +inf beats numbers, a row of -inf gives index 0,
    and `finite` is False for NaN and +-inf maxima."""
    V = 2 * triton_greedy.CHUNK + 100
    x = torch.randn(7, V, generator=torch.Generator().manual_seed(0))
    x[0, 3000] = float("nan")
    x[0, 4000] = float("nan")
    x[0, 10] = float("inf")
    x[1, 2500] = float("inf")
    x[1, 70] = float("inf")
    x[2] = float("-inf")
    x[3, :] = float("-inf")
    x[3, 4100] = -5.0
    x[4, 100] = float("nan")  # a NaN in the first chunk, and a larger value after it
    x[4, 3000] = 1e30
    x[5, ::2] = float("-inf")
    x[6, :] = float("nan")
    _check(x)


def test_half_precision_rows():
    x = torch.randn(2, 3000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    _check(x)


def test_refuses_a_strided_last_dim():
    with pytest.raises(ValueError, match="contiguous last dim"):
        triton_greedy.greedy_tokens(torch.zeros(4, 6)[:, ::2])
