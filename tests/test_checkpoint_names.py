"""Checkpoints whose tensors carry transformers' in-memory names (save_pretrained(save_original_format=False):
NemotronH under `model.` with stacked experts, Granite 4.0's MoE under its experts' and router's module names)
load as the released names do: the same weights, the same tokens."""
from __future__ import annotations

import pytest
import torch

from hybrid import LLM, SamplingParams
from hybrid.loader import weight_files

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 5, 7, 9, 11], [20, 4, 4, 31, 2, 17, 9]]

# (checkpoint, a name the transformers-named copy must hold: proof that the other naming is what loads)
CASES = [("nemotron_h_sharded", "model.embeddings.weight"), ("nemotron_h_latent", "model.layers.1.mixer.experts.up_proj"),
         ("granite_moe", "model.layers.0.block_sparse_moe.experts.gate_up_proj"), ("bamba", None)]


def _tokens(path: str) -> list[list[int]]:
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name,marker", CASES)
def test_transformers_in_memory_names_load(name, marker, tiny_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    import inspect

    if "save_original_format" not in inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters:
        pytest.skip("this transformers saves only the original format")
    src = tiny_ckpt(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, save_original_format=False)
    files = weight_files(str(tmp_path))
    if marker is not None:
        assert marker in files, sorted(files)[:8]
    assert _tokens(str(tmp_path)) == _tokens(src)


def test_tensor_parallel_reads_the_stacked_experts(tiny_ckpt, tmp_path):
    """TP=2 cuts each rank's slice of the stacked experts as it cuts the experts stored one by one."""
    transformers = pytest.importorskip("transformers")
    import inspect

    if "save_original_format" not in inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters:
        pytest.skip("this transformers saves only the original format")
    src = tiny_ckpt("nemotron_h_sharded")
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(
        tmp_path, save_original_format=False)
    two = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=64, tensor_parallel_size=2)
    try:
        assert two.parallel is not None
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        two.parallel.shutdown()
    assert got == _tokens(src)
