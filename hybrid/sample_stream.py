"""A request branch's random numbers for sampling: counter-based streams (SplitMix64), so a seeded
request's draws do not depend on the batch, the device or preemptions (hybrid/sampling.py takes one
draw per sampled token)."""
from __future__ import annotations

import torch

# Seeds are 64-bit (SampleStream; torch.Generator.manual_seed takes the same range and raises
# OverflowError beyond it).
GENERATOR_SEED_RANGE = 2**64


def generator_seed(value: int) -> int:
    """`value` reduced into the generator's seed range [0, 2**64), deterministically. For every value
    torch already accepted (-2**63 .. 2**64 - 1) the generator's stream is unchanged."""
    return value % GENERATOR_SEED_RANGE


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: SplitMix64's increment
_STREAM_SALT = 0x5DEECE66D1CE4E5B  # keeps a stream's key apart from its seed


def splitmix64(x: int) -> int:
    """SplitMix64 (Steele, Lea, Flood 2014): the output for state x (Python ints, mod 2**64).
    splitmix64(0) == 0xE220A8397B1DCDAF, the generator's first output from seed 0."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class SampleStream:
    """A request branch's random numbers, counter based: draw i is a function of (seed, i) only,
    computed on the host, so it is the same on CPU and CUDA, in any batch, after any preemption.
    The sampler takes one draw per sampled token (sample_tokens); `draws` counts them."""

    __slots__ = ("seed", "key", "draws")

    def __init__(self, seed: int) -> None:
        self.seed = generator_seed(seed)  # any int, reduced modulo 2**64
        self.key = splitmix64(self.seed ^ _STREAM_SALT)
        self.draws = 0

    def draw_at(self, i: int) -> int:
        """Draw i as 53 random bits (an int in [0, 2**53)): the token's uniform is this * 2**-53."""
        return splitmix64((self.key + i * _GOLDEN) & _M64) >> 11

    def next_draw(self) -> int:
        d = self.draw_at(self.draws)
        self.draws += 1
        return d

    def __repr__(self) -> str:
        return f"SampleStream(seed={self.seed}, draws={self.draws})"


def draw_bits(generator: "SampleStream | torch.Generator | None") -> int:
    """One 53-bit draw for a sampled row: from its SampleStream; from a torch.Generator (callers
    outside the engine: one randint from it, a host sync if it is a CUDA generator); or, with
    neither, from torch's default CPU generator (fresh randomness unless torch.manual_seed was set)."""
    if isinstance(generator, SampleStream):
        return generator.next_draw()
    if isinstance(generator, torch.Generator):
        return int(torch.randint(0, 2**53, (1,), generator=generator, device=generator.device))
    return int(torch.randint(0, 2**53, (1,)))
