"""hybrid/ops/l2_prefetch.py on the CPU: what a recording makes each launch prefetch, and that nothing prefetches
where the instruction does not exist (the prefetch itself runs only on sm_90+: the GPU tests and the compile
cases)."""
from __future__ import annotations

import pytest
import torch

from hybrid.ops import l2_prefetch


@pytest.fixture(autouse=True)
def _clean():
    l2_prefetch.clear()
    yield
    l2_prefetch.clear()


def test_each_launch_prefetches_the_next_stream_and_the_last_the_first():
    in_proj, out_proj = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    up, shared_up = torch.zeros(4, 16, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    down = torch.zeros(4, 32, 8, dtype=torch.bfloat16)
    with l2_prefetch.recording():
        l2_prefetch.note(in_proj, in_proj)
        l2_prefetch.note(out_proj, out_proj)
        l2_prefetch.note(up, shared_up)  # a MoE GEMM: only its shared slab is known before
        l2_prefetch.note(down, None)  # routed experts only: nothing a launch before could prefetch
    nxt = l2_prefetch._next
    assert nxt[in_proj.data_ptr()][0].data_ptr() == out_proj.data_ptr()
    assert nxt[in_proj.data_ptr()][1] == out_proj.numel() * 2
    assert nxt[out_proj.data_ptr()][0].data_ptr() == shared_up.data_ptr()
    assert nxt[out_proj.data_ptr()][0].dtype == torch.uint8
    assert up.data_ptr() not in nxt  # the launch after it streams nothing known
    assert nxt[down.data_ptr()][0].data_ptr() == in_proj.data_ptr()  # the last: the next step's first


def test_targets_are_capped_and_whole_16_byte_units():
    big = torch.zeros(l2_prefetch.MAX_BYTES + 4096, dtype=torch.uint8)
    odd = torch.zeros(40, dtype=torch.uint8)  # 40 bytes: 32 of them prefetched
    a, b = torch.zeros(8), torch.zeros(8)
    with l2_prefetch.recording():
        l2_prefetch.note(a, a)
        l2_prefetch.note(b, big)
        l2_prefetch.note(odd, odd)
    assert l2_prefetch._next[a.data_ptr()][1] == l2_prefetch.MAX_BYTES
    assert l2_prefetch._next[b.data_ptr()][1] == 32


def test_a_weight_used_twice_keeps_its_first_successor():
    shared_block, x, y = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    with l2_prefetch.recording():
        for w in (shared_block, x, shared_block, y):  # Zamba2's shared transformer block
            l2_prefetch.note(w, w)
    assert l2_prefetch._next[shared_block.data_ptr()][0].data_ptr() == x.data_ptr()
    assert l2_prefetch._next[y.data_ptr()][0].data_ptr() == shared_block.data_ptr()


def test_a_new_recording_replaces_the_old_one_and_a_failed_one_leaves_none():
    a, b = torch.zeros(64), torch.zeros(64)
    with l2_prefetch.recording():
        l2_prefetch.note(a, a)
        l2_prefetch.note(b, b)
    assert l2_prefetch._next
    with pytest.raises(RuntimeError):
        with l2_prefetch.recording():
            l2_prefetch.note(a, a)
            raise RuntimeError("the step failed")
    assert not l2_prefetch._next
    l2_prefetch.note(a, a)  # outside a recording: nothing
    assert not l2_prefetch._next


def test_no_prefetch_on_the_cpu(monkeypatch):
    from hybrid.ops import triton_guard

    monkeypatch.setenv("HYBRID_L2_PREFETCH", "1")
    triton_guard.reset_switches()
    try:
        a, b = torch.zeros(64), torch.zeros(64)
        with l2_prefetch.recording():
            l2_prefetch.note(a, a)
            l2_prefetch.note(b, b)
        assert l2_prefetch._next  # recorded ...
        args = l2_prefetch.launch_args(a, programs=8)  # ... but the CPU has no bulk prefetch
        assert args["PF"] is False and args["pf_bytes"] == 0
    finally:
        monkeypatch.delenv("HYBRID_L2_PREFETCH")
        triton_guard.reset_switches()


def test_pieces_cover_the_target(monkeypatch):
    """launch_args' pieces: whole 16-byte units, at most MAX_PIECE, and each program's LANES pieces (piece i of
    program p at (p + i * programs) * piece) cover the target unless the piece is at its cap."""
    monkeypatch.setattr(l2_prefetch, "enabled", lambda device: True)
    for size, programs in ((24 << 20, 806), (9437184, 384), (6291456, 48), (1 << 20, 1), (4096, 2000)):
        key, target = torch.zeros(1), torch.zeros(size, dtype=torch.uint8)
        with l2_prefetch.recording():
            l2_prefetch.note(key, key)
            l2_prefetch.note(target, target)
        args = l2_prefetch.launch_args(key, programs)
        piece = args["pf_piece"]
        assert args["PF"] is True and args["pf_bytes"] == size and args["pf_ptr"].data_ptr() == target.data_ptr()
        assert piece % 16 == 0 and l2_prefetch.MIN_PIECE <= piece <= l2_prefetch.MAX_PIECE
        assert programs * l2_prefetch.LANES * piece >= size or piece == l2_prefetch.MAX_PIECE
