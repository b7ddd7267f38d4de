"""FP8 at load (vLLM's `quantization="fp8"` on an unquantized checkpoint): the loaded model's projections and routed
experts quantized in place, as an FP8 checkpoint of the per-channel dynamic scheme would load (ModelOpt's
FP8_PER_CHANNEL_PER_TOKEN, compressed-tensors' FP8_DYNAMIC; hybrid/tools/quantize_fp8.py with --per-channel
--dynamic writes such checkpoints from the same weights, and they load to the same FP8 weights and scales).

Quantized: every projection (hybrid.layers.Linear: Mamba in/out, attention qkv/o, MLPs, shared experts, LatentMoE's
latent projections, Zamba2's per-layer linear) and the routed experts; one absmax scale per output row. Kept as
they are: the LM head, embeddings, norms, routers, conv1d, the SSM parameters, Zamba2's low-rank adapters. The
routed experts stay in FP8 where the fused MoE kernel reads e4m3 (CUDA sm_89+), and are rounded to FP8 and back
elsewhere, as the loader treats an FP8 checkpoint's experts there.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.fp8_linear import Fp8Linear, dequantize, keep_fp8_experts
from hybrid.quantization import DYNAMIC, FP8_DTYPE, FP8_MAX

def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per output row) of `w` ([out, in] or stacked [E, out, in]): scale = absmax / 448,
    weight = round_e4m3(w / scale)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.squeeze(-1).contiguous()


def quantize_model_fp8(model: nn.Module, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """Quantize `model` in place (module docstring). Returns (projections, Experts modules) quantized."""
    from hybrid.layers import Linear
    from hybrid.moe import Experts

    lm_head = getattr(model, "lm_head", None)
    keep = keep_fp8_experts(device)
    projections = experts = 0
    for name, module in list(model.named_modules()):
        if type(module) is Linear and module is not lm_head:
            q, scale = quantize_rows(module.weight.data)
            bias = module.bias.data if module.bias is not None else None
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Fp8Linear(q, scale, None, DYNAMIC, bias))
            module.weight = None  # (the 16-bit weight goes now, not after the whole model)
            projections += 1
        elif isinstance(module, Experts) and not module.fp8:
            for which in ("up", "down"):
                q, scale = quantize_rows(getattr(module, which).data)
                if keep:
                    setattr(module, which, nn.Parameter(q, requires_grad=False))
                    setattr(module, f"{which}_scale", scale)
                else:  # the loader's numerics for an FP8 checkpoint's experts here: rounded, then dequantized
                    setattr(module, which, nn.Parameter(dequantize(q, scale[..., None]).to(dtype),
                                                        requires_grad=False))
            experts += 1
    return projections, experts
