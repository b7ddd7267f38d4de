"""Helpers of the FP8 tests: tiny FP8 checkpoints (hybrid.tools.quantize_fp8), and a pure-torch
reference of an FP8 checkpoint's numerics written independently of hybrid/quantization.py:

* `dequantized_copy` writes the checkpoint with every FP8 weight replaced by weight.float() *
  weight_scale (fp32), scales and quantization config dropped;
* `fake_quant_hooks` makes the runtime's plain `Linear` projections of that copy quantize their
  input to e4m3 and back, as the FP8 checkpoint says (static input_scale or per token);
* `hf_fake_quant_hooks` does the same on a transformers model's nn.Linear modules (the oracle).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

FP8_MAX = 448.0
SCHEMES = {  # name: (format, per_channel, dynamic)
    "modelopt_fp8": ("modelopt", False, False),
    "modelopt_pcpt": ("modelopt", True, True),
    "ct_fp8": ("compressed-tensors", False, False),
    "ct_fp8_dynamic": ("compressed-tensors", True, True),
    "ct_tensor_dynamic": ("compressed-tensors", False, True),
    "ct_channel_static": ("compressed-tensors", True, False),
}


def quantize(src, dst, scheme: str, **kwargs) -> str:
    from hybrid.tools.quantize_fp8 import quantize_checkpoint

    fmt, per_channel, dynamic = SCHEMES[scheme]
    return quantize_checkpoint(str(src), str(dst), fmt, per_channel=per_channel, dynamic=dynamic, **kwargs)


def read_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _fq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def _per_token(x: torch.Tensor) -> torch.Tensor:
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1.0 / (FP8_MAX * 512.0))


def dequantized_copy(fp8_dir, out_dir) -> tuple[str, dict[str, torch.Tensor | None]]:
    """(directory of the dequantized fp32 copy, {on-disk module: static input scale, or None when
    its activations are quantized per token}) for the FP8 weights of `fp8_dir`. The config's
    activation mode is read from the quantization config itself."""
    t = read_tensors(fp8_dir)
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    qc = cfg.pop("quantization_config", None)
    hf = os.path.join(fp8_dir, "hf_quant_config.json")
    if qc is None:
        qc = json.load(open(hf))
    if qc.get("quant_method") == "compressed-tensors":
        dynamic = qc["config_groups"]["group_0"]["input_activations"]["dynamic"]
    else:
        dynamic = qc.get("quantization", qc)["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    out, act = {}, {}
    for name, w in t.items():
        if name.endswith((".weight_scale", ".input_scale", "k_scale", "v_scale")):
            continue
        if w.dtype == torch.float8_e4m3fn:
            module = name[: -len(".weight")]
            s = t[module + ".weight_scale"].float()
            if w.dim() == 3:
                s = s.reshape(s.shape[0], -1, 1)
            elif s.numel() > 1:
                s = s.reshape(-1, 1)
            out[name] = w.float() * s
            act[module] = None if dynamic else t[module + ".input_scale"].float()
        else:
            out[name] = w
    os.makedirs(out_dir, exist_ok=True)
    from safetensors.torch import save_file

    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(fp8_dir):
        if not f.endswith(".safetensors") and f not in ("config.json", "hf_quant_config.json",
                                                         "model.safetensors.index.json"):
            shutil.copy(os.path.join(fp8_dir, f), out_dir)
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    return str(out_dir), act


def fake_quant_hooks(llm, act: dict[str, torch.Tensor | None]) -> int:
    """Hook the runtime's plain Linear projections whose on-disk parts were FP8: their input is
    quantized to e4m3 with the parts' largest static input scale (divided by the input multiplier
    the loader folds into the weights, Falcon-H1's), or per token. Returns how many were hooked."""
    from hybrid.layers import Linear
    from hybrid.tensor_plan import tensor_plan

    plan = tensor_plan(llm.config)
    hooked = 0
    for name, mod in llm.model.named_modules():
        if type(mod) is not Linear or name == "lm_head":
            continue
        src = plan[f"{name}.weight"]
        parts = [n[: -len(".weight")] for n in src.disk_names]
        if not any(p in act for p in parts):
            continue
        assert all(p in act for p in parts)
        if act[parts[0]] is None:
            mod.register_forward_pre_hook(lambda m, args: (_fq(args[0], _per_token(args[0])),))
        else:
            s = torch.stack([act[p].reshape(()) for p in parts]).max() / src.input_multiplier
            mod.register_forward_pre_hook(lambda m, args, s=s: (_fq(args[0], s),))
        hooked += 1
    return hooked


def hf_fake_quant_hooks(model, act: dict[str, torch.Tensor | None]) -> int:
    """The same on a transformers model: every nn.Linear whose on-disk module was FP8 (its in-memory
    name, or with NemotronH's `backbone.` prefix), except Zamba2's adapters (dequantized at load,
    run in the model dtype by the runtime), quantizes its input with the module's own scale."""
    import re

    cfg = model.config
    hybrid = [i for i, t in enumerate(getattr(cfg, "layers_block_type", None) or []) if t == "hybrid"]
    hooked = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or "adapter_list" in name:
            continue
        disk = name if name in act else "backbone." + name.removeprefix("model.")
        m = re.match(r"model\.layers\.(\d+)\.shared_transformer\.(.*)", name)
        if m and hybrid:  # Zamba2: hybrid layer j runs shared block j % num_mem_blocks, stored under hybrid[k]
            j = hybrid.index(int(m.group(1)))
            disk = f"model.layers.{hybrid[j % min(cfg.num_mem_blocks, len(hybrid))]}.shared_transformer.{m.group(2)}"
        if disk not in act:
            continue
        s = act[disk]
        if s is None:
            mod.register_forward_pre_hook(lambda m, args: (_fq(args[0], _per_token(args[0])),))
        else:
            mod.register_forward_pre_hook(lambda m, args, s=s.reshape(()): (_fq(args[0], s),))
        hooked += 1
    return hooked
