"""The startup warm-up: a few throw-away requests through the engine, so that the kernels the first
real batch would compile are compiled during startup.

Why: Triton (and FlashInfer's JIT) compile a kernel per specialisation the first time it is met,
and a step's specialisations depend on its shape: how many requests a prefill chunk holds (one is
specialised apart from several), whether the sizes are multiples of 16, decode rows mixed into a
prefill step, chunks with a history (initial states), speculative verify rows, the sampler's
top-p/top-k/min-p path and log-probabilities. The memory plan's profiling forward (one request)
and the graph capture (decode only) meet few of them, so the first real batch paid the rest. The
warm-up meets the common ones the way requests do, through `Engine.add_request` / `Engine.step`,
so it needs no path of its own: its requests take slots and pages as any request does and give
them back. Afterwards nothing of it is left: no request, no cached prefix, zeroed statistics.

Requests cannot choose how the scheduler cuts their prompts into chunks, and the Mamba prefill's
chunked scan (mamba-ssm's Triton kernels) compiles per class of chunk length and chunk count (1, a
multiple of 16, other: Triton's integer specialisation; on the H200 a first batch of 256 x 1024-token
prompts spent ~9 s of its 17.5 s prefill compiling, and a 16 x 128-token batch after a restart 3.7 s).
So before the requests the runner runs each Mamba layer shape's prefill path once per class
(`ModelRunner.warm_up_prefill_kernels`, on the pool's scratch row). Likewise the fused MoE kernels
change tiles, alignment method and the shared expert's place at step sizes that depend on the expert
count: each MoE layer shape runs once per distinct launch plan (`ModelRunner.warm_up_moe_kernels`).

On by default on CUDA (`LLM(warmup=...)`, `hybrid serve --no-warmup`); off on CPU, where nothing
compiles. Its time is the "warm-up" phase of the startup log.
"""
from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from hybrid.sampling import SamplingParams, warm_up_fallback_kernel

if TYPE_CHECKING:
    from hybrid.engine import Engine

logger = logging.getLogger("hybrid")

MAX_STEPS = 10_000  # a guard: the warm-up's requests finish in a few dozen steps


def warmup_requests(vocab_size: int, max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int,
                    speculative: bool) -> list[tuple[list[int], SamplingParams]]:
    """(prompt token ids, params) of the warm-up requests: prompts of 1 token, of a length that is
    no multiple of 16, of one over the step budget (chunked, so a later chunk has a history and
    shares its step with the others' decodes), greedy and sampled (top-p, top-k, min-p, a seed,
    log-probabilities, a penalty); with speculation, a repeating prompt (n-gram drafts exist)."""
    rng = random.Random(0)
    new_tokens = 4
    room = max(1, max_model_len - new_tokens - 1)  # every prompt leaves room for its new tokens

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(max(1, min(n, room)))]

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=new_tokens, temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=1,
                             logprobs=2, repetition_penalty=1.1, ignore_eos=True)
    lengths = [1, 37, 100, max_num_batched_tokens + 37]
    out = [(prompt(n), greedy if i % 2 == 0 else sampled) for i, n in enumerate(lengths)]
    if speculative:
        period = prompt(6)
        out.append(((period * 8)[:room], greedy))
    return out[:max(1, max_num_seqs)]


def warm_up(engine: Engine, *, vocab_size: int, max_num_batched_tokens: int, max_model_len: int,
            max_num_seqs: int, runner_stats: dict[str, int] | None = None) -> int:
    """Run the Mamba prefill specialisations, then the warm-up requests to their end, and leave the
    engine as it was: returns the steps run."""
    prefill_kernels = getattr(engine.runner, "warm_up_prefill_kernels", None)  # absent on test doubles
    if prefill_kernels is not None:
        # one row is at most max_model_len tokens; a step's rows together up to max_num_batched_tokens (the varlen
        # scan's totals: a throughput run at max_model_len 1281 compiled two of its variants mid-run, on an H100)
        launches = prefill_kernels(min(max_num_batched_tokens, max_model_len), max_num_batched_tokens)
        logger.debug("warm-up: %d Mamba prefill launches", launches)
    moe_kernels = getattr(engine.runner, "warm_up_moe_kernels", None)
    if moe_kernels is not None:
        calls = moe_kernels(max_num_batched_tokens)
        logger.debug("warm-up: %d MoE layer calls", calls)
    device = getattr(engine, "device", None)  # (absent on test doubles)
    if device is not None:  # both variants of the sampler's full-row kernel (one warm-up step has one)
        warm_up_fallback_kernel(device, vocab_size)
    requests = warmup_requests(vocab_size, max_num_batched_tokens, max_model_len, max_num_seqs,
                               speculative=engine.spec_config is not None)
    ids = [f"warmup-{i}" for i in range(len(requests))]
    for rid, (tokens, params) in zip(ids, requests):
        engine.add_request(rid, tokens, params, output_kind="final")
    steps = 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps >= MAX_STEPS:
                raise RuntimeError(f"the startup warm-up did not finish in {MAX_STEPS} steps")
    finally:
        for rid in ids:
            engine.abort_request(rid)
    engine.forget_history()  # nothing of the warm-up stays
    if runner_stats is not None:
        for key in runner_stats:
            runner_stats[key] = 0
    return steps
