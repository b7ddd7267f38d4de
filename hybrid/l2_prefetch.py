"""Which weights a decode-sized step asks L2 for, and where (the kernel: hybrid/ops/triton_prefetch.py).

At batch 1 a layer of a small MoE hybrid (Granite-4.0-H-Tiny) is a dozen short kernels; the
projections among them read their weights from HBM at a fraction of its bandwidth, and the kernels
between them (conv, SSM update, norms, router) move almost nothing. A prefetch point issues, a few
kernels ahead, the L2 prefetch of the weights that come next, so they stream in while those small
kernels run:
- after a Mamba layer's in_proj (or an attention layer's qkv): its out_proj (o_proj) and the block's
  own MLP or shared-expert weights, used after the conv, SSM update and gated norm;
- after an MoE layer's routing: the chosen experts' rows (up and down) and the next block's first
  projection.

A point's fixed weights are kept in order while they fit in `budget` bytes (a share of L2: more
would evict what was prefetched before it is read); the routed rows only where the step's rows fit
too. Points fire for steps of at most MAX_TOKENS tokens, with the "l2_prefetch" switches
(HYBRID_L2_PREFETCH=1: both kinds, =static: fixed weights only, =rows: routed rows only;
hybrid/ops/triton_guard.py), on sm_90+ devices. A hint only: no value changes either way.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.ops import triton_prefetch
from hybrid.ops.triton_guard import switch

MAX_TOKENS = 16  # decode-sized steps: past this the projections stream near the copy rate on their own
L2_SHARE = 0.75  # of the L2 size, the most one point asks for


def enabled() -> tuple[bool, bool]:
    """(fixed weights on, routed rows on) by the switches."""
    both = switch("l2_prefetch")
    return both or switch("l2_prefetch_static"), both or switch("l2_prefetch_rows")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fits(t: torch.Tensor) -> bool:
    """A region the bulk prefetch can take: contiguous, from a 16-byte aligned address."""
    return t.is_contiguous() and t.data_ptr() % triton_prefetch.ALIGN == 0


class PrefetchPoint:
    """The weights one point of the forward asks L2 for: `fixed` tensors (whole) and `stacked`
    expert stacks (the rows a routing picks)."""

    def __init__(self, fixed: list[torch.Tensor], stacked: list[torch.Tensor], budget: int) -> None:
        kept, total = [], 0
        for t in fixed:
            if _fits(t) and total + _nbytes(t) <= budget:
                kept.append(t)
                total += _nbytes(t)
        stacked = [s for s in stacked if _fits(s) and _nbytes(s[0]) % triton_prefetch.ALIGN == 0]
        self.budget = budget
        self.fixed, self.stacked = kept, stacked
        self.fixed_bytes = total
        self.row_bytes = sum(_nbytes(s[0]) for s in stacked)  # one id's rows, over the stacks
        device = (kept or stacked)[0].device if (kept or stacked) else torch.device("cpu")
        self.fixed_table = triton_prefetch.region_table(kept, [], device)
        self.rows_table = triton_prefetch.region_table([], stacked, device)
        self.all_table = triton_prefetch.region_table(kept, stacked, device)
        self.max_fixed = max((_nbytes(t) for t in kept), default=0)
        self.max_row = max((_nbytes(s[0]) for s in stacked), default=0)

    def __bool__(self) -> bool:
        return bool(self.fixed or self.stacked)

    def issue(self, num_tokens: int, ids: torch.Tensor | None = None) -> None:
        """Prefetch this point's weights for a step of `num_tokens` tokens (`ids`: the routing's
        expert ids, [T * k] contiguous, for the stacked rows), as the switches say."""
        if num_tokens > MAX_TOKENS:
            return
        fixed_on, rows_on = enabled()
        fixed = fixed_on and bool(self.fixed)
        rows = (rows_on and ids is not None and bool(self.stacked)
                and ids.numel() * self.row_bytes + (self.fixed_bytes if fixed else 0) <= self.budget)
        if fixed and rows:
            triton_prefetch.prefetch(self.all_table, max(self.max_fixed, self.max_row), ids)
        elif fixed:
            triton_prefetch.prefetch(self.fixed_table, self.max_fixed)
        elif rows:
            triton_prefetch.prefetch(self.rows_table, self.max_row, ids)


def _weight(proj: nn.Module | None) -> list[torch.Tensor]:
    w = getattr(proj, "weight", None)
    return [w] if isinstance(w, torch.Tensor) and w.device.type != "meta" else []


def _mlp_weights(mlp: nn.Module | None) -> list[torch.Tensor]:
    """A dense or gated MLP's weights in the order it reads them."""
    if mlp is None:
        return []
    first = getattr(mlp, "gate_up_proj", None) or getattr(mlp, "up_proj", None)
    return _weight(first) + _weight(getattr(mlp, "down_proj", None))


def _first_weight(block: nn.Module) -> list[torch.Tensor]:
    """The first projection a block reads (a Mamba in_proj or an attention qkv), if it has one."""
    from hybrid.layers import Attention, Mamba2Mixer

    mixer = getattr(block, "mixer", None)
    if isinstance(mixer, Mamba2Mixer):
        return _weight(mixer.in_proj)
    if isinstance(mixer, Attention):
        return _weight(mixer.qkv_proj)
    return []


def plan_l2_prefetch(model: nn.Module, budget: int | None = None) -> int:
    """Set the prefetch points of `model`'s blocks (NemotronH and Granite / Bamba blocks; others get
    none): Mamba2Mixer.l2_after_in_proj, Attention.l2_after_qkv, the MoE layers' l2_after_route.
    `budget`: the most bytes one point asks for (default L2_SHARE of the device's L2). Returns how
    many points hold something. A no-op off sm_90+ CUDA devices."""
    from hybrid.layers import Attention, Mamba2Mixer
    from hybrid.model import NemotronHBlock, TwoStageBlock
    from hybrid.moe import GraniteMoE, NemotronMoE

    layers = getattr(model, "layers", None)
    param = next(model.parameters(), None)
    if layers is None or param is None or not triton_prefetch.is_available(param.device):
        return 0
    if budget is None:
        budget = int(torch.cuda.get_device_properties(param.device).L2_cache_size * L2_SHARE)
    count = 0
    for i, block in enumerate(layers):
        if not isinstance(block, (NemotronHBlock, TwoStageBlock)):
            continue
        following = _first_weight(layers[i + 1]) if i + 1 < len(layers) else []
        mixer = block.mixer
        own_mlp = _mlp_weights(block.mlp) if isinstance(block, TwoStageBlock) else []
        point = None
        if isinstance(mixer, Mamba2Mixer):
            point = mixer.l2_after_in_proj = PrefetchPoint(_weight(mixer.out_proj) + own_mlp, [], budget)
        elif isinstance(mixer, Attention):
            point = mixer.l2_after_qkv = PrefetchPoint(_weight(mixer.o_proj) + own_mlp, [], budget)
        count += bool(point)
        moe = block.moe if isinstance(block, TwoStageBlock) else mixer
        if isinstance(moe, (GraniteMoE, NemotronMoE)) and moe.experts.fused:
            shared = _mlp_weights(moe.shared) if isinstance(moe, NemotronMoE) else []
            moe.l2_after_route = PrefetchPoint(shared + following, [moe.experts.up, moe.experts.down], budget)
            count += bool(moe.l2_after_route)
    return count
