"""One rank's model: built with the local config, its row-parallel layers retyped, loaded by
hybrid/loader.py with each tensor read as this rank's slice (no rank reads the whole checkpoint)."""
from __future__ import annotations

import torch

from hybrid.config import GATE_ONLY, ModelConfig
from hybrid.layers import Attention, DenseMLP, GatedMLP, Mamba2Mixer
from hybrid.model import HybridModel, TwoStageBlock
from hybrid.moe import Experts, NemotronMoE
from hybrid.parallel.group import TPGroup
from hybrid.parallel.layers import GroupNormStats, ParallelExperts, RowParallelLinear, ShardedHybridModel, retype
from hybrid.parallel.sharding import Cut, ShardRules, check_shapes, local_config, mamba_group_shared


class ShardPlan:
    """What load_model needs to load rank `group.rank`'s shard of a checkpoint of config `cfg`."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        check_shapes(cfg, group.world_size)
        self.cfg, self.group = cfg, group
        self.local_cfg = local_config(cfg, group.world_size)
        self.rules = ShardRules(cfg, group.world_size, group.rank)
        # the full model on the meta device: only its parameter shapes are read
        self._full = {n: p.shape for n, p in HybridModel(cfg).named_parameters()}

    def full_shape(self, name: str) -> torch.Size:
        return self._full[name]

    def cut(self, name: str) -> Cut | None:
        return self.rules.cut(name, self._full[name])

    def build(self) -> ShardedHybridModel:
        model = HybridModel(self.local_cfg)
        retype(model, ShardedHybridModel, self.group)
        model.full_vocab_size = self.cfg.vocab_size
        g, tp = self.group, self.group.world_size
        shared_groups = mamba_group_shared(self.cfg, tp) and self.cfg.mamba.gate != GATE_ONLY
        # the shared expert of an MoE layer stays partial: the experts' one all-reduce sums it with
        # the routed experts (one collective per MoE layer; on CUDA it may still fold into their launches).
        # LatentMoE's experts reduce their latent sum before the (whole) projection back up, so its
        # shared expert is row-parallel with its own all-reduce.
        partial = set()
        for m in model.modules():
            if isinstance(m, NemotronMoE) and m.latent_in_proj is None:
                partial.add(id(m.shared))
            elif isinstance(m, TwoStageBlock) and m.moe is not None:
                partial.add(id(m.mlp))
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                retype(m.out_proj, RowParallelLinear, g)
                if shared_groups:
                    m.norm_stats = GroupNormStats(g, self.cfg.mamba.n_groups)
            elif isinstance(m, Attention):
                retype(m.o_proj, RowParallelLinear, g)
            elif isinstance(m, (DenseMLP, GatedMLP)) and id(m) not in partial:
                retype(m.down_proj, RowParallelLinear, g)
            elif isinstance(m, (DenseMLP, GatedMLP)):
                assert m.down_proj.bias is None, "a partial shared expert cannot carry a bias (it would be summed N times)"
            elif isinstance(m, Experts):
                retype(m, ParallelExperts, g)
        return model
