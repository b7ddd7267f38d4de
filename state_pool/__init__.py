"""Mamba state manager: one slot per live request holding every Mamba layer's conv and SSM state."""
from state_pool.pool import PAD_SLOT_ID, MambaStatePool, SlotAllocator, StateShapes

__all__ = ["PAD_SLOT_ID", "MambaStatePool", "SlotAllocator", "StateShapes"]
