"""Slot allocation and the dense per-slot Mamba state tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Padding rows of a batch carry this slot id; they must never read or write a live slot.
PAD_SLOT_ID = -1


@dataclass(frozen=True)
class StateShapes:
    num_layers: int  # number of Mamba layers
    conv_dim: int  # channels of the depthwise causal conv (x, B and C)
    conv_width: int  # columns of history kept per channel: conv kernel size - 1
    num_heads: int
    head_dim: int
    state_size: int

    def bytes_per_slot(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=conv_dtype).element_size()
        ssm = self.num_heads * self.head_dim * self.state_size * torch.empty((), dtype=ssm_dtype).element_size()
        return self.num_layers * (conv + ssm)


class SlotAllocator:
    """Hands out slot ids in [0, num_slots). Lowest id first, so tests see deterministic reuse."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() returns the lowest id
        self._live: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def live(self) -> frozenset[int]:
        return frozenset(self._live)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._live.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._live:
            raise RuntimeError(f"double free of Mamba slot {slot}")
        self._live.remove(slot)
        self._free.append(slot)
        # keep lowest-first order
        self._free.sort(reverse=True)


class MambaStatePool:
    """Conv and SSM state of every Mamba layer for `num_slots` requests.

    conv_state: [layers, num_slots + 1, conv_dim, conv_width]
    ssm_state:  [layers, num_slots + 1, heads, head_dim, state_size]
    Row `num_slots` is a scratch row that no request ever owns: kernels that cannot skip
    PAD_SLOT_ID are pointed there, so padding can never touch a live slot.
    """

    def __init__(
        self,
        shapes: StateShapes,
        num_slots: int,
        device: torch.device | str = "cpu",
        conv_dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
        poison_freed: bool = False,
    ) -> None:
        self.shapes = shapes
        self.num_slots = num_slots
        self.allocator = SlotAllocator(num_slots)
        # Sanitizer mode: freed slots are filled with NaN so that any read of one shows up.
        self.poison_freed = poison_freed
        # Speculative verify scratch (see enable_spec_scratch); None until speculation is on.
        self.spec_conv: torch.Tensor | None = None
        self.spec_ssm: torch.Tensor | None = None
        rows = num_slots + 1
        self.conv_state = torch.zeros(
            shapes.num_layers, rows, shapes.conv_dim, shapes.conv_width, device=device, dtype=conv_dtype
        )
        self.ssm_state = torch.zeros(
            shapes.num_layers, rows, shapes.num_heads, shapes.head_dim, shapes.state_size, device=device, dtype=ssm_dtype
        )

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def live_slots(self) -> frozenset[int]:
        return self.allocator.live

    def allocate(self) -> int | None:
        """A free slot, zeroed, or None when every slot is in use."""
        slot = self.allocator.allocate()
        if slot is not None:
            # Belt and braces: the first chunk of a request also ignores whatever the slot holds.
            self.conv_state[:, slot].zero_()
            self.ssm_state[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.allocator.free(slot)
        if self.poison_freed:
            self.poison(slot)

    def poison(self, slot: int) -> None:
        """Fill a slot with NaN (sanitizer): a later read of it turns the reader's logits into NaN."""
        self.conv_state[:, slot].fill_(float("nan"))
        self.ssm_state[:, slot].fill_(float("nan"))

    def copy_slot(self, src: int, dst: int) -> None:
        """Make `dst` an exact copy of `src` (every layer), for copy-on-write forks."""
        live = self.allocator.live
        if src not in live or dst not in live or src == dst:
            raise RuntimeError(f"copy_slot({src} -> {dst}): both slots must be live and distinct")
        self.conv_state[:, dst].copy_(self.conv_state[:, src])
        self.ssm_state[:, dst].copy_(self.ssm_state[:, src])

    def fork(self, src: int) -> int | None:
        """A new slot holding an exact copy of `src`, or None when every slot is in use."""
        dst = self.allocator.allocate()
        if dst is not None:
            self.copy_slot(src, dst)
        return dst

    # ------------------------------------------------------------------ speculative verify
    def enable_spec_scratch(self, num_rows: int, num_positions: int) -> None:
        """Scratch for verify steps: the state after each of `num_positions` tokens of up to `num_rows`
        verify requests per step.

        spec_conv: [layers, num_rows, num_positions, conv_dim, conv_width]
        spec_ssm:  [layers, num_rows, num_positions, heads, head_dim, state_size]
        A verify request with scratch index r leaves in [:, r, j] the state after its j-th new token
        (j = 0 is the last accepted token, j >= 1 the drafts); its own slot is left untouched until
        `commit_spec` copies the accepted position into it.
        """
        sh = self.shapes
        dev = self.conv_state.device
        if (self.spec_conv is not None and self.spec_conv.shape[1] >= num_rows
                and self.spec_conv.shape[2] >= num_positions):
            return
        self.spec_conv = torch.zeros(sh.num_layers, num_rows, num_positions, sh.conv_dim, sh.conv_width,
                                     device=dev, dtype=self.conv_state.dtype)
        self.spec_ssm = torch.zeros(sh.num_layers, num_rows, num_positions, sh.num_heads, sh.head_dim,
                                    sh.state_size, device=dev, dtype=self.ssm_state.dtype)

    @property
    def spec_scratch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec_conv is None:
            return None
        return self.spec_conv, self.spec_ssm

    def commit_spec(self, slot: int, scratch_index: int, position: int) -> None:
        """After verification: the slot takes the state after new token `position` of its verify row."""
        if slot not in self.allocator.live:
            raise RuntimeError(f"commit of verify state into Mamba slot {slot}, which is not live")
        self.conv_state[:, slot].copy_(self.spec_conv[:, scratch_index, position])
        self.ssm_state[:, slot].copy_(self.spec_ssm[:, scratch_index, position])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv_state, ssm_state) views of one Mamba layer, each [num_slots + 1, ...]."""
        return self.conv_state[index], self.ssm_state[index]
