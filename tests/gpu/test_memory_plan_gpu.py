"""Startup of an 8B-shaped Nemotron-H (zero weights, tests/model_shapes.py) with speculation on the
GPU: a configuration whose verify scratch does not fit fails in the constructor with CapacityError
(never torch.OutOfMemoryError later); one that fits has the scratch in its memory plan and allocated.
CPU twin of the arithmetic: tests/test_memory_plan.py."""
import gc

import pytest
import torch

from graphs.padding import CONTEXT_BUCKET_MAX_BATCH, verify_graph_sizes
from hybrid import LLM, SamplingParams
from hybrid.errors import CapacityError
from model_shapes import NEMOTRON_H_8B

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture
def model_8b(monkeypatch):
    import hybrid.llm as L
    from hybrid.config_parse import parse_config
    from hybrid.model import HybridModel

    cfg = parse_config(NEMOTRON_H_8B)

    def load(model_dir, c, device, dtype, **_):
        model = HybridModel(c)
        for name, p in list(model.named_parameters()):
            mod_path, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_path) if mod_path else model
            zeros = torch.zeros(p.shape, device=device, dtype=dtype)
            setattr(mod, attr, torch.nn.Parameter(zeros, requires_grad=False))
        for m in model.modules():
            for b, buf in list(m._buffers.items()):
                if buf is not None:
                    m._buffers[b] = buf.to(device)
        return model

    monkeypatch.setattr(L, "load_config", lambda d: cfg)
    monkeypatch.setattr(L, "load_model", load)
    yield "/nonexistent-8b-shaped-model"
    gc.collect()
    torch.cuda.empty_cache()


def _llm(path, max_num_seqs, **kw):
    kw.setdefault("enforce_eager", True)
    return LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs, max_model_len=16384,
               max_num_batched_tokens=512, mamba_ssm_dtype="float32", speculative_config=SPEC, **kw)


def test_8b_spec_at_256_sequences_fails_at_startup(model_8b):
    with pytest.raises(CapacityError, match="speculative verify scratch"):
        _llm(model_8b, 256)


def test_8b_spec_that_fits_has_the_scratch_in_the_plan(model_8b):
    sizes = [1, 2, 4, 8, 16, 32]
    llm = _llm(model_8b, 32, enforce_eager=False, cuda_graph_sizes=sizes)
    plan, pool = llm.memory_plan, llm.state_pool
    assert plan.spec_scratch_bytes == 32 * 4 * plan.slot_bytes > 0
    # the graph reserve holds every bucket's fp32 logits (captured or not: graphs need the mamba kernels),
    # and every verify bucket's (K+1 rows a request; verify graphs are on by default with speculation)
    k = SPEC["num_speculative_tokens"]
    verify = verify_graph_sizes(sizes, 32)
    assert verify and max(verify) <= 32
    assert sorted(llm.runner.verify_graphs) == verify  # captured: the reserve is for graphs that exist
    # and the buckets of at most CONTEXT_BUCKET_MAX_BATCH rows once more for each narrower context they are
    # captured at (16K here: 4K and 8K tables too)
    widths = llm.runner.context_widths
    assert [w * llm.runner.page_size for w in widths] == [4096, 8192, 16384]
    narrow = sum(s for s in sizes if s <= CONTEXT_BUCKET_MAX_BATCH) * (len(widths) - 1)
    assert plan.graph_reserve_bytes == 512 * 2**20 + (sum(sizes) + narrow + sum(verify) * (k + 1)) * 131072 * 4
    assert pool.spec_ssm is not None and pool.spec_ssm.shape[1:3] == (32, 4)
    out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    del llm, pool
