"""A small Mamba2Mixer with random weights on the CPU, for the tests that run its CUDA dispatch
(hybrid/ops/mamba_cuda.py) through Triton's interpreter."""
import math

import torch

from hybrid.config import MambaConfig
from hybrid.layers import Mamba2Mixer

CFG = MambaConfig(num_heads=4, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, conv_bias=True,
                  proj_bias=False, norm_eps=1e-5, dt_limit=(0.0, math.inf))


def random_mixer(dtype: torch.dtype, hidden: int = 32, seed: int = 0) -> Mamba2Mixer:
    """CFG's mixer: weights ~ N(0, 0.3^2), A in [-5, -1], dt_bias for dt in [0.01, 0.1]."""
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(hidden, CFG, 0).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.3)
        mixer.A_log.copy_(torch.log(torch.rand(CFG.num_heads) * 4 + 1))
        mixer.dt_bias.copy_(torch.log(torch.expm1(torch.rand(CFG.num_heads) * 0.09 + 0.01)))
    return mixer
