"""Prompt-lookup (n-gram) speculative decoding: proposer, config and the acceptance rule.

A decoding sequence whose recent tokens reappear earlier in its own context gets up to K draft
tokens: the tokens that followed the most recent earlier occurrence of its last n tokens
(n from prompt_lookup_max down to prompt_lookup_min). The engine then runs a *verify* step for it:
its last sampled token plus the K drafts go through the model in one pass (attention is causal
over them; the Mamba layers run the one-step decode recurrence token by token and keep the state
after each position in the pool's verify scratch). Then, position by position, the engine samples
the target token from the logits with the sequence's own sampler and generator and accepts the
draft iff it equals that token; the first mismatch (or the bonus position after K accepted
drafts) emits the sampled token and stops. The slot then takes the scratch state after its last
accepted input, and `num_computed` (hence seq_lens) excludes rejected positions, whose KV rows are
simply overwritten later.

With no draft probabilities (n-gram drafts are deterministic), "accept iff equal to the token
sampled from the target distribution" keeps the output distribution exactly the target's; and
since exactly one sample is drawn per emitted token, a seeded request emits the same tokens with
or without speculation (greedy: always).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    @classmethod
    def from_dict(cls, cfg: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if cfg is None:
            return None
        if isinstance(cfg, SpeculativeConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise ValueError("speculative_config must be a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 3}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}")
        method = cfg.get("method", "ngram")
        if method not in ("ngram", "prompt_lookup"):
            raise ValueError(f"speculative_config method '{method}' is not supported (only 'ngram')")
        k = cfg.get("num_speculative_tokens", 3)
        hi = cfg.get("prompt_lookup_max", 3)
        lo = cfg.get("prompt_lookup_min", 1)
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config {name}={v!r} must be an integer >= 1")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} > prompt_lookup_max={hi}")
        return cls("ngram", k, hi, lo)


class NgramProposer:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to min(K, max_drafts) draft tokens continuing `tokens`, or [] when no n-gram matches."""
        k = min(self.cfg.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        n_tok = len(tokens)
        for n in range(min(self.cfg.prompt_lookup_max, n_tok - 1), self.cfg.prompt_lookup_min - 1, -1):
            suffix = tokens[n_tok - n:]
            # the most recent earlier occurrence of the suffix (not the suffix itself); what followed
            # it is the draft, continued periodically (period = distance between the occurrences)
            # when the occurrence overlaps the suffix
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    period = n_tok - n - start
                    ext = list(tokens[start + n:])
                    while len(ext) < k:
                        ext.append(ext[len(ext) - period])
                    return ext[:k]
        return []


def verify_drafts(drafts: list[int], emit: Callable[[int], int], stopped: Callable[[], bool]) -> tuple[int, int]:
    """The acceptance rule of a verify row: position j = 0..len(drafts) emits the token sampled from
    the target there (`emit(j)`, which appends it to the sequence and returns it); the draft at j is
    accepted iff it equals that token. Stops at the first mismatch, after the bonus position, or
    when the emitted token ended the sequence (`stopped()`). Returns (emitted, accepted): inputs
    0..emitted-1 (the last token and the accepted drafts) are then the ones in the cache."""
    emitted = accepted = 0
    for j in range(len(drafts) + 1):
        token = emit(j)
        emitted += 1
        matched = j < len(drafts) and token == drafts[j]
        accepted += matched
        if stopped() or not matched:
            break
    return emitted, accepted
