"""The layers' tensor-parallel variants: a row-parallel Linear (all-reduce, then the bias once),
routed experts whose partial sums are reduced before the shared expert's output is added, the
Mamba gated norm's group statistics over ranks, and the vocab-parallel embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.layers import Linear
from hybrid.model import HybridModel
from hybrid.moe import Experts
from hybrid.parallel.group import TPGroup


class RowParallelLinear(Linear):
    """Input features split over the ranks: each computes its partial product, one all-reduce sums
    them, the (replicated) bias is added once, after the sum."""

    group: TPGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ParallelExperts(Experts):
    """Experts with the intermediate dim split: each rank's sum over its slice of every chosen
    expert is partial, and so is `add` / `shared` (the shared expert, its down projection left
    unreduced: hybrid/parallel/shard_model.py); one all-reduce sums both."""

    group: TPGroup
    can_defer_sum = False  # the all-reduce needs the summed output

    def forward(self, x, top_idx, top_w, add=None, shared=None, router=None):
        return self.group.all_reduce(super().forward(x, top_idx, top_w, add, shared, router))


class GroupNormStats:
    """Mamba gated norm when each group's channels span several ranks (n_groups < tp): the mean of
    squares over a rank's channels of its group is averaged over the tp / n_groups ranks that hold
    that group (equal shares), which is the mean over the whole group."""

    def __init__(self, group: TPGroup, n_groups: int) -> None:
        self.group, self.n_groups = group, n_groups
        self.share = group.world_size // n_groups  # ranks per group
        self.mine = group.rank // self.share  # this rank's group

    def __call__(self, mean_sq: torch.Tensor) -> torch.Tensor:  # [T, 1, 1] -> [T, 1, 1]
        buf = mean_sq.new_zeros(mean_sq.shape[0], self.n_groups)
        buf[:, self.mine] = mean_sq[:, 0, 0]
        self.group.all_reduce(buf)
        return (buf[:, self.mine] / self.share)[:, None, None]


class ShardedHybridModel(HybridModel):
    """One rank's shard of the model (built with the local config, hybrid/parallel/sharding.py):
    vocab-parallel embedding (rows outside the rank's range read as zero, one all-reduce) and LM
    head (each rank's logits columns, one all-gather); every rank returns the full logits."""

    group: TPGroup
    full_vocab_size: int

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed.shape[0]
        local = ids - self.group.rank * rows
        inside = (local >= 0) & (local < rows)
        h = F.embedding(local.clamp(0, rows - 1), self.embed) * inside[:, None].to(self.embed.dtype)
        return self.group.all_reduce(h)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        local = super().lm_logits(h)
        return self.group.all_gather(local)[:, : self.full_vocab_size]


def retype(module: torch.nn.Module, cls: type, group: TPGroup) -> None:
    """Turn `module` into its parallel subclass `cls` in place (its parameters, still on the meta
    device, keep their names, so the loader's plan is unchanged)."""
    module.__class__ = cls
    module.group = group
