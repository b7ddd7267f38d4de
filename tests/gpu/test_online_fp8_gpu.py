"""FP8 at load on the device (hybrid/online_fp8.py): the quantized model equals the per-channel dynamic FP8
checkpoint of the same weights (the same e4m3 weights and scales, the routed experts kept in FP8 for the fused MoE
kernel), and the two engines give the same greedy tokens under CUDA graphs."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fp8_reference as R  # noqa: E402
from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.moe import Experts  # noqa: E402


def _bf16_copy(src, dst):
    """The checkpoint with its floating-point tensors stored in bf16, as released checkpoints are: the engine's
    bf16 weights are then the stored ones, which the quantization tool reads."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".safetensors"):
            path = os.path.join(dst, f)
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()}
            save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("family", ["granite_moe", "nemotron_h"])
def test_fp8_at_load_equals_the_checkpoint_on_the_device(family, tiny_ckpt, tmp_path):
    src = _bf16_copy(tiny_ckpt(family), tmp_path / "bf16")
    kw = dict(device="cuda", max_num_seqs=4, max_model_len=256, gpu_memory_utilization=0.3)
    online = LLM(src, quantization="fp8", **kw)
    ckpt = LLM(R.quantize(src, tmp_path / "pcpt", "modelopt_pcpt"), **kw)
    a = dict(online.model.named_parameters())
    b = dict(ckpt.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].float(), b[name].float()), name
    for m, n in zip(online.model.modules(), ckpt.model.modules()):
        if isinstance(m, Experts):
            assert m.fp8 and m.up.dtype == torch.float8_e4m3fn and torch.equal(m.up_scale, n.up_scale)
    prompts = [[5, 9, 14, 3, 7, 22, 11], [40, 41, 8, 19, 2, 33, 6, 17, 25, 12], [3, 4]]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [[o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] for llm in (online, ckpt)]
    assert got[0] == got[1]
    assert online.runner.stats["graph_replays"] > 0
