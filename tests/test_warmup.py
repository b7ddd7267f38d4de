"""The startup warm-up (hybrid/warmup.py): its throw-away requests leave nothing behind (no request,
slot, page, cached prefix, statistic or shifted sampling seed), and an engine that warmed up
generates exactly what one that did not generates. On CUDA it is on by default; here it is asked for."""
import pytest

from hybrid import LLM, SamplingParams
from hybrid.engine_config import engine_config
from hybrid.warmup import warmup_requests

KW = dict(device="cpu", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=48, page_size=8, check_state=True)
PROMPTS = [[5, 9, 3, 7, 11, 2, 4] * 3, [8, 1, 6], list(range(3, 60))]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, ignore_eos=True),  # unseeded: by arrival
          SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=3, logprobs=2, ignore_eos=True)]


def _run(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("extra", [dict(), dict(enable_prefix_caching=True),
                                   dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["plain", "prefix-caching", "speculation"])
def test_warmup_leaves_nothing_behind(tiny_ckpt, extra):
    path = tiny_ckpt("nemotron_h")
    cold = LLM(path, warmup=False, **KW, **extra)
    warm = LLM(path, warmup=True, **KW, **extra)
    assert "warm-up" in warm.startup_phases and "warm-up" not in cold.startup_phases
    engine = warm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert warm.state_pool.num_free == cold.state_pool.num_free
    assert engine.resources.num_free_pages == cold.engine.resources.num_free_pages
    assert engine.prefix_cache is None or len(engine.prefix_cache) == 0
    assert all(v == 0 for v in engine.stats.values()), engine.stats
    assert all(v == 0 for v in warm.runner.stats.values()), warm.runner.stats
    assert _run(warm) == _run(cold)
    assert engine.stats == cold.engine.stats


def test_warmup_requests_cover_the_step_shapes():
    reqs = warmup_requests(vocab_size=100, max_num_batched_tokens=48, max_model_len=128, max_num_seqs=8,
                           speculative=True)
    lengths = [len(t) for t, _ in reqs]
    assert 1 in lengths and any(n % 16 for n in lengths) and max(lengths) > 48  # chunked: a chunk with a history
    assert all(0 <= t < 100 for toks, _ in reqs for t in toks)
    assert all(len(t) + p.max_tokens <= 128 for t, p in reqs)
    assert {p.temperature == 0.0 for _, p in reqs} == {True, False}  # greedy and sampled steps
    periodic = reqs[-1][0]
    assert periodic[:6] == periodic[6:12]  # n-gram drafts exist for the speculative verify rows
    # a tiny context: every prompt still leaves room for its new tokens; max_num_seqs 1: one request
    small = warmup_requests(vocab_size=100, max_num_batched_tokens=48, max_model_len=8, max_num_seqs=1,
                            speculative=False)
    assert len(small) == 1 and all(len(t) + p.max_tokens <= 8 for t, p in small)


def test_warmup_default_is_cuda_only():
    assert engine_config(device="cpu").warmup is False
    assert engine_config(device="cpu", warmup=True).warmup is True


@pytest.mark.parametrize("chunk", [8, 64, 128, 256])
@pytest.mark.parametrize("budget", [100, 3900, 8192])
def test_prefill_warmup_lengths_meet_every_specialisation_class(chunk, budget):
    """The Mamba prefill warm-up's chunk lengths meet every (length, chunk count, chunk count x chunk
    size) triple of Triton's integer classes (1, a multiple of 16, other) that a chunk within the budget can have (found
    here by trying every length), and none is over the budget."""
    from hybrid.ops.mamba_cuda import prefill_warmup_lengths

    def cls(n):
        return "1" if n == 1 else "D" if n % 16 == 0 else "N"

    def pair(n):
        return cls(n), cls(-(-n // chunk)), cls(-(-n // chunk) * chunk)

    lengths = prefill_warmup_lengths(chunk, budget)
    assert all(1 <= n <= budget for n in lengths)
    assert {pair(n) for n in lengths} == {pair(n) for n in range(1, budget + 1)}
    if chunk >= 64 and budget >= 16 * chunk:
        assert len(lengths) == 7  # (1, 1) and each of the other six


@pytest.mark.parametrize("chunk", [8, 64, 256])
@pytest.mark.parametrize("budget", [100, 3900, 8192])
def test_varlen_warmup_lengths_meet_every_residue_pair(chunk, budget):
    """The varlen warm-up's step totals meet every (total mod 16, chunk count: 1 or mod 16) pair that a
    total from 2 to the budget can have (every total tried here), so any product of the total or of
    the chunk count with a fixed stride falls in a class the warm-up met; none is over the budget."""
    from hybrid.ops.mamba_cuda import varlen_warmup_lengths

    def sig(n):
        chunks = -(-n // chunk)
        return n % 16, -1 if chunks == 1 else chunks % 16

    lengths = varlen_warmup_lengths(chunk, budget)
    assert all(2 <= n <= budget for n in lengths) and len(set(lengths)) == len(lengths)
    assert {sig(n) for n in lengths} == {sig(n) for n in range(2, budget + 1)}
    assert len(lengths) <= 16 * 17


def test_prefill_warmup_runs_on_the_scratch_row_only(tiny_ckpt):
    """ModelRunner.warm_up_prefill_kernels runs each distinct Mamba layer shape's prefill once per
    length, from a zero and from a given state, on the pool's scratch row only, and leaves that row
    zero; every live slot is untouched (kernels stand-in: the CUDA path needs mamba-ssm)."""
    import math

    import torch

    from hybrid.ops.mamba_cuda import MambaCudaKernels, prefill_warmup_lengths, varlen_warmup_lengths

    class Recording(MambaCudaKernels):
        def __init__(self):  # no library kernels on the CPU
            self.decode_kernels, self.calls = "triton", []

        def params(self, mixer):
            return {}

        def _prefill_row(self, mixer, p, xBC, dt, conv_state, ssm_state, slot, has_init):
            self.calls.append((xBC.shape[0], has_init, slot, xBC.stride(0), dt.stride(0)))
            conv_state[slot].fill_(3.0)
            ssm_state[slot].fill_(3.0)
            return torch.zeros(xBC.shape[0], mixer.cfg.num_heads, mixer.cfg.head_dim)

        def _prefill_varlen(self, mixer, p, xBC, dt, conv_state, ssm_state, rows):
            self.varlen_calls.append((xBC.shape[0], rows.slots.tolist(), rows.has_init.tolist(),
                                      rows.cu_seqlens.tolist()))
            conv_state[rows.slots.long()] = 3.0
            ssm_state[rows.slots.long()] = 3.0
            return torch.zeros(xBC.shape[0], mixer.cfg.num_heads, mixer.cfg.head_dim)

    llm = LLM(tiny_ckpt("nemotron_h"), warmup=False, **KW)
    kernels = Recording()
    kernels.varlen_calls = []
    mixers = llm.model.mamba_mixers()
    for m in mixers:
        m.kernels = kernels
    pool = llm.state_pool
    pool.conv_state.fill_(7.0)
    pool.ssm_state.fill_(7.0)
    try:
        runs = llm.runner.warm_up_prefill_kernels(48, 100)  # rows of at most 48 tokens, steps of up to 100
    finally:
        for m in mixers:
            m.kernels = None
    cfg = mixers[0].cfg
    lengths = prefill_warmup_lengths(cfg.chunk_size, 48)
    width = cfg.intermediate_size + cfg.conv_dim + cfg.num_heads  # the in_proj output's row, as in the forward
    # rows of a width no multiple of 16 bytes: every pointer alignment a request's first row can have
    aligned = 16 // math.gcd(width * llm.model.embed.element_size(), 16)
    scratch = pool.conv_state.shape[1] - 1
    # the tiny model's Mamba layers share one shape: one pass; the varlen path (on by default) at the same
    # lengths as two rows, then at the further totals of varlen_warmup_lengths
    extra = sorted(set(varlen_warmup_lengths(cfg.chunk_size, 100)) - set(lengths))
    # (a step of several rows totals more than one row may hold: its totals past 48 are met too)
    assert max(extra) > 48 and max(c[0] for c in kernels.calls) <= 48
    assert len(kernels.calls) == 2 * aligned * len(lengths)
    two_rows = [n for n in lengths if n >= 2]
    assert runs == len(kernels.calls) + len(kernels.varlen_calls)
    assert sorted(c[0] for c in kernels.varlen_calls) == sorted([n for n in two_rows for _ in range(2 * aligned)]
                                                                 + extra)
    assert all(c[1] == [scratch, scratch] and c[3] == [0, c[0] - 1, c[0]] for c in kernels.varlen_calls)
    assert sorted(c[:2] for c in kernels.calls) == sorted((n, h) for n in lengths for h in (False, True)
                                                          for _ in range(aligned))
    # the library kernels' methods are the class's (a module-level function once split the class)
    assert all(callable(getattr(MambaCudaKernels, n, None))
               for n in ("_library_conv_prefill", "_library_replay", "_library_step", "_prefill_row"))
    assert all(c[2] == scratch and c[3] == c[4] == width for c in kernels.calls)
    ran = mixers[0].layer_index  # the one layer of that shape it ran on: its scratch row ends zero
    for state in (pool.conv_state, pool.ssm_state):
        assert bool((state[ran, scratch] == 0).all())
        untouched = torch.ones(state.shape[:2], dtype=torch.bool)
        untouched[ran, scratch] = False
        assert bool((state[untouched] == 7).all())  # every live slot, and the other layers' scratch
