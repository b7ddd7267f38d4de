"""Unit tests of the Mamba state pool: allocation, zeroing, poisoning, fork copies, verify commit."""
from __future__ import annotations

import math

import pytest
import torch

from state_pool.pool import MambaStatePool, StateShapes

torch.set_num_threads(1)  # 2 cores shared by several people: 2 threads here run ~20x slower

SHAPES = StateShapes(num_layers=2, conv_dim=6, conv_width=3, num_heads=2, head_dim=4, state_size=5)


def _fill(pool: MambaStatePool, slot: int, value: float) -> None:
    pool.conv_state[:, slot].fill_(value)
    pool.ssm_state[:, slot].fill_(value)


def test_allocate_lowest_first_and_zeroed():
    pool = MambaStatePool(SHAPES, 3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.allocate() is None  # out of slots: the caller waits
    _fill(pool, 1, 7.0)
    pool.free(1)
    assert pool.allocate() == 1
    assert pool.conv_state[:, 1].abs().sum() == 0 and pool.ssm_state[:, 1].abs().sum() == 0


def test_double_free_raises():
    pool = MambaStatePool(SHAPES, 2)
    s = pool.allocate()
    pool.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(s)


def test_poison_on_free_only_in_sanitizer_mode():
    pool = MambaStatePool(SHAPES, 2)
    s = pool.allocate()
    _fill(pool, s, 3.0)
    pool.free(s)
    assert not torch.isnan(pool.ssm_state[:, s]).any()  # off: freeing touches nothing
    pool.poison_freed = True
    s = pool.allocate()
    other = pool.allocate()
    _fill(pool, other, 5.0)
    pool.free(s)
    assert torch.isnan(pool.conv_state[:, s]).all() and torch.isnan(pool.ssm_state[:, s]).all()
    assert (pool.ssm_state[:, other] == 5.0).all()  # neighbours untouched
    assert (pool.ssm_state[:, pool.scratch_slot] == 0).all()
    assert pool.allocate() == s and pool.ssm_state[:, s].abs().sum() == 0  # recycled: zeroed again


def test_fork_is_an_exact_independent_copy():
    pool = MambaStatePool(SHAPES, 3)
    src = pool.allocate()
    torch.manual_seed(0)
    pool.conv_state[:, src] = torch.randn_like(pool.conv_state[:, src])
    pool.ssm_state[:, src] = torch.randn_like(pool.ssm_state[:, src])
    dst = pool.fork(src)
    assert dst not in (None, src)
    assert torch.equal(pool.conv_state[:, dst], pool.conv_state[:, src])
    assert torch.equal(pool.ssm_state[:, dst], pool.ssm_state[:, src])
    pool.ssm_state[:, dst] += 1  # writing the child leaves the parent alone
    assert not torch.equal(pool.ssm_state[:, dst], pool.ssm_state[:, src])
    pool.free(dst)
    with pytest.raises(RuntimeError):
        pool.copy_slot(src, dst)  # never into a freed slot
    pool.allocate(), pool.allocate()
    assert pool.fork(src) is None  # no slot free: fork waits


def test_commit_spec_copies_the_accepted_position():
    pool = MambaStatePool(SHAPES, 2)
    pool.enable_spec_scratch(num_rows=2, num_positions=4)
    slot = pool.allocate()
    for j in range(4):
        pool.spec_conv[:, 1, j] = float(j + 1)
        pool.spec_ssm[:, 1, j] = float(10 * (j + 1))
    pool.commit_spec(slot, scratch_index=1, position=2)
    assert (pool.conv_state[:, slot] == 3.0).all() and (pool.ssm_state[:, slot] == 30.0).all()
    pool.free(slot)
    with pytest.raises(RuntimeError):
        pool.commit_spec(slot, 1, 0)


def test_bytes_per_slot():
    n = SHAPES.bytes_per_slot(torch.float32, torch.float32)
    assert n == 2 * (6 * 3 + 2 * 4 * 5) * 4
    assert not math.isnan(n)
