"""The Hugging Face transformers reference ("oracle") for the parity tests.

The checkpoint is loaded exactly as a user would load it (``from_pretrained`` from the
directory on disk, eager attention, fp32) and every prompt is run alone (batch 1, no
padding), greedy, with a fixed number of new tokens (eos never stops it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class OracleRun:
    prompt: list[int]
    tokens: list[int]              # generated ids (len == max_new_tokens)
    logprobs: torch.Tensor         # [max_new_tokens, vocab] fp32 log_softmax of the raw logits

    def top2_gap(self, step: int) -> float:
        top = torch.topk(self.logprobs[step], 2).values
        return float(top[0] - top[1])

    def min_top2_gap(self) -> float:
        return min(self.top2_gap(i) for i in range(len(self.tokens)))


@functools.lru_cache(maxsize=8)
def load_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    )
    model.eval()
    return model


@torch.no_grad()
def _generate_one(model, prompt: list[int], max_new_tokens: int) -> OracleRun:
    input_ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
        # neutralise anything a generation_config.json could switch on
        temperature=None,
        top_p=None,
        top_k=None,
        repetition_penalty=None,
        num_beams=1,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens, (len(tokens), max_new_tokens)
    logits = torch.stack([step[0] for step in out.logits]).float()  # raw (unprocessed) logits
    logprobs = torch.log_softmax(logits, dim=-1)
    # sanity: greedy really picked the argmax of the raw logits
    assert tokens == logits.argmax(-1).tolist()
    return OracleRun(prompt=list(prompt), tokens=tokens, logprobs=logprobs)


@functools.lru_cache(maxsize=256)
def _cached(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> OracleRun:
    return _generate_one(load_model(path), list(prompt), max_new_tokens)


def oracle_run(path, prompt, max_new_tokens: int) -> OracleRun:
    """Greedy HF run of one prompt alone (memoised per checkpoint/prompt/length)."""
    return _cached(str(path), tuple(int(t) for t in prompt), int(max_new_tokens))


def greedy_tokens(path, prompts, max_new_tokens: int) -> list[list[int]]:
    """HF greedy continuation of each prompt, each run alone (batch 1, no padding)."""
    return [oracle_run(path, p, max_new_tokens).tokens for p in prompts]


def step_logprobs(path, prompt, max_new_tokens: int) -> torch.Tensor:
    """[max_new_tokens, vocab] fp32 log_softmax of HF's logits at each generation step
    (row 0 comes from the prefill forward, the rest from one-token decode forwards)."""
    return oracle_run(path, prompt, max_new_tokens).logprobs


@torch.no_grad()
def full_forward_logprobs(path, ids: list[int]) -> torch.Tensor:
    """log_softmax of a single no-cache forward over `ids` (all positions): [len(ids), vocab]."""
    model = load_model(str(path))
    out = model(torch.tensor([ids]), use_cache=False)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


# ----------------------------------------------------------------------------------------
# prompts and comparison helpers shared by the test modules
# ----------------------------------------------------------------------------------------

PROMPT_LENGTHS = (1, 5, 8, 17, 27)
MAX_NEW = 32
# Greedy token-for-token comparison is only well-posed where the reference's top-2 logit gap is
# far above fp32 rounding noise (~1e-5 here). Prompts are drawn from fixed seeds and a draw is
# kept only if every step of its HF continuation has a top-2 gap >= GAP_MIN: this excludes
# near-ties, not failures (it never looks at the runtime).
GAP_MIN = 2e-3


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (length,), generator=g).tolist()


def select_prompts(path, lengths=PROMPT_LENGTHS, max_new_tokens: int = MAX_NEW,
                   gap_min: float = GAP_MIN, tries: int = 40) -> dict[int, list[int]]:
    """{length: prompt}: for each length the first seed whose HF greedy continuation of
    `max_new_tokens` tokens has no near-tie (top-2 gap >= gap_min at every step)."""
    import json
    import os

    with open(os.path.join(str(path), "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    out = {}
    for length in lengths:
        for attempt in range(tries):
            p = random_prompt(vocab, length, seed=10_000 * length + attempt)
            if oracle_run(path, p, max_new_tokens).min_top2_gap() >= gap_min:
                out[length] = p
                break
        else:
            raise AssertionError(f"{path}: no well-conditioned prompt of length {length} in {tries} draws")
    return out


def describe_divergence(run: OracleRun, got: list[int], got_logprobs=None) -> str | None:
    """None if `got` equals the oracle tokens, else a one-paragraph diagnosis."""
    want = run.tokens
    if list(got) == want:
        return None
    n = min(len(got), len(want))
    k = next((i for i in range(n) if got[i] != want[i]), n)
    msg = [f"prompt len {len(run.prompt)}: runtime produced {len(got)} tokens, HF {len(want)}"]
    if k < n:
        lp = run.logprobs[k]
        msg.append(
            f"first divergence at generated token {k} ({'prefill' if k == 0 else 'decode'} step): "
            f"runtime {got[k]} (HF logprob {float(lp[got[k]]):.5f}) vs HF {want[k]} "
            f"(HF logprob {float(lp[want[k]]):.5f}); HF top-2 gap there {run.top2_gap(k):.5f}"
        )
        if got_logprobs is not None and k < len(got_logprobs):
            d = got_logprobs[k]
            diffs = [abs(v - float(lp[t])) for t, v in d.items()]
            msg.append(f"runtime logprobs at that step {dict(d)}; max |diff| vs HF {max(diffs):.3g}")
    msg.append(f"runtime: {list(got)}")
    msg.append(f"HF     : {want}")
    return "\n  ".join(msg)
