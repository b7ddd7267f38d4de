"""FP8 at load (vLLM's quantization="fp8" on a checkpoint that is not quantized, hybrid/online_fp8.py): the model
equals the one an FP8 checkpoint of the per-channel dynamic scheme loads (hybrid.tools.quantize_fp8 --per-channel
--dynamic, ModelOpt's FP8_PER_CHANNEL_PER_TOKEN) from the same weights: the same e4m3 weights and scales, the same
logits and tokens; and it differs from the 16-bit model by FP8's rounding only."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_reference as R  # noqa: E402
from hybrid import SamplingParams  # noqa: E402
from hybrid.errors import ConfigurationError  # noqa: E402
from hybrid.fp8_linear import Fp8Linear  # noqa: E402
from hybrid.layers import Linear  # noqa: E402
from hybrid.moe import Experts  # noqa: E402
from hybrid.online_fp8 import quantize_rows  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 7, 22, 11], [40, 41, 8, 19, 2, 33, 6, 17, 25, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


def test_quantize_rows_is_the_absmax_scheme():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0 * 3, 1.0, -7.0]])
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3,)
    assert torch.allclose(scale, torch.tensor([2.0 / 448, 1e-12, 3.0]))
    assert q.float()[0, 1] == -448 and q.float()[2, 0] == 448 and bool((q.float()[1] == 0).all())
    stacked_q, stacked_scale = quantize_rows(torch.stack([w, 2 * w]))
    assert stacked_scale.shape == (2, 3) and torch.equal(stacked_q[0], q)


def _params(llm) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in llm.model.named_parameters()}


@pytest.mark.parametrize("family", ["nemotron_h", "granite_moe"])
def test_fp8_at_load_equals_the_per_channel_dynamic_checkpoint(family, tiny_ckpt, make_llm, tmp_path):
    src = tiny_ckpt(family)
    online = make_llm(src, quantization="fp8", max_num_seqs=2)
    ckpt = make_llm(R.quantize(src, tmp_path / "pcpt", "modelopt_pcpt"), max_num_seqs=2)
    plain = make_llm(src, max_num_seqs=2)
    fp8 = [m for m in online.model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.activation == "dynamic" and m.weight_scale.dim() == 1 for m in fp8)
    assert not [n for n, m in online.model.named_modules() if type(m) is Linear and not n.endswith("lm_head")]
    a, b = _params(online), _params(ckpt)
    assert a.keys() == b.keys()
    for name in a:  # the same weights, scales and everything else, bit for bit
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].float(), b[name].float()), name
    if family == "granite_moe":  # CPU: the experts rounded to FP8 and back, as an FP8 checkpoint's are here
        experts = next(m for m in online.model.modules() if isinstance(m, Experts))
        assert not experts.fp8 and experts.up.dtype == torch.float32
        assert not torch.equal(experts.up, next(m for m in plain.model.modules() if isinstance(m, Experts)).up)
    outs = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for llm in (online, ckpt, plain)]
    tokens = [[o.outputs[0].token_ids for o in out] for out in outs]
    assert tokens[0] == tokens[1]
    for o, c in zip(outs[0], outs[1]):
        assert o.outputs[0].logprobs == c.outputs[0].logprobs
    # FP8 moves the log-probs a little from the 16-bit model's, no more
    first = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outs[0]]
    first_plain = [o.outputs[0].logprobs[0].get(o.outputs[0].token_ids[0]) for o in outs[2]]
    for lp, ref in zip(first, first_plain):
        if ref is not None:
            assert abs(lp - ref.logprob) < 0.5


def test_fp8_names_what_it_cannot_do(tiny_ckpt, make_llm):
    with pytest.raises(ConfigurationError, match="names a checkpoint format"):
        make_llm(tiny_ckpt("nemotron_h"), quantization="modelopt")
    with pytest.raises(ConfigurationError, match="tensor_parallel_size=1"):
        make_llm(tiny_ckpt("nemotron_h"), quantization="fp8", tensor_parallel_size=2)


def test_the_cli_quantizes_at_load(capsys):
    from hybrid.cli import main

    assert main(["generate", "--prompt", "And the LORD said", "--device", "cpu", "--quantization", "fp8",
                 "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
