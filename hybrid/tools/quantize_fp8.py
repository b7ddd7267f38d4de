"""Quantize a bf16/fp32 checkpoint of a supported family into an FP8 (e4m3) checkpoint, in the
NVIDIA ModelOpt or the compressed-tensors (llm-compressor) format, as those tools write them.

    python -m hybrid.tools.quantize_fp8 SRC DST --format modelopt|compressed-tensors \\
        [--per-channel] [--dynamic] [--exclude PATTERN ...] [--modelopt-config hf_quant_config|config] \\
        [--kv-cache-scales] [--calibration-prompts N] [--calibration-tokens N] [--seed S]

Weights: absmax scales, per tensor (one value) or, with --per-channel, per output row
(weight_scale = absmax / 448; weight = round_e4m3(weight / weight_scale)). Activations: static
per-tensor input scales calibrated on our own runtime (CPU, fp32) over random prompts (the
absmax of each projection's input / 448), or, with --dynamic, none (quantized per token at run
time). ModelOpt expresses two combinations: per-tensor + static (quant_algo FP8) and per-channel +
dynamic (FP8_PER_CHANNEL_PER_TOKEN); compressed-tensors all four.

Quantized: every linear projection (Mamba in/out, attention q/k/v/o, MLP, shared experts, Zamba2's
per-layer linear and adapters) and the routed experts. Kept as they are: the LM head, embeddings,
norms, routers, conv1d, A_log / D / dt_bias, biases, and whatever --exclude names (ModelOpt:
wildcards; compressed-tensors: names or `re:` regexes, over on-disk module names).

The output keeps the source's shard layout (each weight's scales go to its shard) and copies the
other files (tokenizer, generation config); config.json gains the quantization_config
(compressed-tensors, or ModelOpt with --modelopt-config config), else ModelOpt's
hf_quant_config.json is written. A dev tool (the tests build their tiny FP8 checkpoints with it);
each shard is held in memory while it is converted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from collections import defaultdict

import torch

FP8_MAX = 448.0


def _exclusions(fmt: str, extra: list[str]) -> list[str]:
    if fmt == "modelopt":
        return ["lm_head", "*router*", "*mixer.gate"] + extra
    return ["lm_head", "re:.*router.*", r"re:.*mixer\.gate$"] + extra


def quant_config(fmt: str, per_channel: bool, dynamic: bool, exclude: list[str], kv: bool) -> dict:
    """The quantization config, as the format's own tool writes it (compressed-tensors: the
    quantization_config of config.json; ModelOpt: hf_quant_config.json)."""
    if fmt == "modelopt":
        if per_channel != dynamic:
            raise SystemExit("ModelOpt expresses per-tensor weights with static activations (FP8) and per-channel "
                             "weights with dynamic per-token activations (FP8_PER_CHANNEL_PER_TOKEN); use both or "
                             "neither of --per-channel / --dynamic, or --format compressed-tensors")
        return {"producer": {"name": "modelopt", "version": "emulated by hybrid.tools.quantize_fp8"},
                "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN" if per_channel else "FP8",
                                 "kv_cache_quant_algo": "FP8" if kv else None,
                                 "exclude_modules": exclude}}
    args = dict(num_bits=8, type="float", symmetric=True, group_size=None, block_structure=None, actorder=None,
                observer_kwargs={})
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": dict(args, strategy="channel" if per_channel else "tensor", dynamic=False, observer="minmax"),
            "input_activations": dict(args, strategy="token" if dynamic else "tensor", dynamic=dynamic,
                                      observer=None if dynamic else "minmax"),
            "output_activations": None,
        }},
        "ignore": exclude,
        "kv_cache_scheme": ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                             "symmetric": True} if kv else None),
        "global_compression_ratio": None, "version": "emulated by hybrid.tools.quantize_fp8",
    }


def quantize_weight(w: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale): absmax scales per tensor ([] / per expert [E, 1, 1]) or per output row
    ([out, 1] / [E, out, 1]), stored in `scale_dtype`; the weight is divided by the stored scale."""
    a = w.float().abs()
    if w.dim() == 3:  # stacked experts [E, out, in]
        amax = a.amax(dim=-1, keepdim=True) if per_channel else a.amax(dim=(1, 2), keepdim=True)
    else:
        amax = a.amax(dim=-1, keepdim=True) if per_channel else a.amax()
    scale = (amax / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def calibrate(src: str, prompts: int, tokens: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Run our runtime (CPU, fp32) on random prompts and record the absmax of the input of every
    on-disk linear module ({module: amax}, a vector [E] for stacked experts) and of the keys / values
    of every attention module ({prefix + 'k'|'v': amax})."""
    from hybrid import LLM, SamplingParams
    from hybrid.layers import Attention, Linear, LowRankAdapter
    from hybrid.moe import Experts
    from hybrid.tensor_plan import tensor_plan

    llm = LLM(src, device="cpu", dtype="float32")
    cfg, model = llm.config, llm.model
    plan = tensor_plan(cfg)
    amax: dict[str, torch.Tensor] = {}
    kv_amax: dict[str, float] = {}

    def record(module: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        amax[module] = torch.maximum(amax[module], value) if module in amax else value

    def disk_modules(param: str) -> list[str]:
        return [n.removesuffix(".weight") for n in plan[param].disk_names]

    hooks = []
    for name, mod in model.named_modules():
        if type(mod) is Linear:
            src_ = plan[f"{name}.weight"]
            mult = src_.input_multiplier

            def linear_hook(m, args, mods=disk_modules(f"{name}.weight"), mult=mult):
                for d in mods:  # the parts of a fused projection share its input
                    record(d, args[0].abs().amax() * mult)
            hooks.append(mod.register_forward_pre_hook(linear_hook))
        elif isinstance(mod, Experts):
            def experts_hook(m, args, name=name):
                x, top_idx = args[0], args[1]
                ups, downs = [], []
                for e in range(m.up.shape[0]):
                    rows = (top_idx == e).any(-1)
                    xe = x[rows]
                    if xe.shape[0] == 0:
                        ups.append(torch.zeros(())), downs.append(torch.zeros(()))
                        continue
                    h = torch.nn.functional.linear(xe, m.up[e])
                    if m.gated:
                        g, u = h.chunk(2, dim=-1)
                        h = m.act(g) * u
                    else:
                        h = m.act(h)
                    ups.append(xe.abs().amax()), downs.append(h.abs().amax())
                for leaf, vals in (("up", ups), ("down", downs)):
                    mods = disk_modules(f"{name}.{leaf}")
                    if len(mods) == 1:  # one stacked tensor: a vector over experts
                        record(mods[0], torch.stack(vals))
                    else:
                        for d, v in zip(mods, vals):
                            record(d, v)
            hooks.append(mod.register_forward_pre_hook(experts_hook))
        elif isinstance(mod, LowRankAdapter):
            def adapter_hook(m, args, name=name):
                x = args[0]
                h = torch.nn.functional.linear(x, m.down).view(x.shape[0], m.parts, m.rank)
                for d in disk_modules(f"{name}.down"):
                    record(d, x.abs().amax())
                for p, d in enumerate(disk_modules(f"{name}.up")):
                    record(d, h[:, p].abs().amax())
            hooks.append(mod.register_forward_pre_hook(adapter_hook))
        if isinstance(mod, Attention) and type(mod.qkv_proj) is Linear:
            prefix = plan[f"{name}.qkv_proj.weight"].disk_names[0].rsplit(".", 2)[0] + "."

            def kv_hook(m, args, out, prefix=prefix, attn=mod):
                _, k, v = torch.split(out, [attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
                for key, t in (("k", k), ("v", v)):
                    kv_amax[prefix + key] = max(kv_amax.get(prefix + key, 0.0), float(t.abs().amax()))
            hooks.append(mod.qkv_proj.register_forward_hook(kv_hook))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, cfg.vocab_size, (prompts, tokens), generator=g).tolist()
    llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for h in hooks:
        h.remove()
    return amax, kv_amax


def quantize_checkpoint(src: str, dst: str, fmt: str, per_channel: bool = False, dynamic: bool = False,
                        exclude: list[str] | None = None, modelopt_config: str = "hf_quant_config",
                        kv_cache_scales: bool = False, calibration_prompts: int = 8, calibration_tokens: int = 32,
                        seed: int = 0) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hybrid.config_fields import read_json
    from hybrid.config_parse import load_config
    from hybrid.layers import Linear
    from hybrid.loader import weight_files
    from hybrid.model import HybridModel
    from hybrid.quantization import read_quant_config
    from hybrid.tensor_plan import tensor_plan

    if fmt not in ("modelopt", "compressed-tensors"):
        raise SystemExit(f"unknown --format {fmt!r} (modelopt | compressed-tensors)")
    cfg = load_config(src)
    exclude = _exclusions(fmt, list(exclude or []))
    qcfg = quant_config(fmt, per_channel, dynamic, exclude, kv_cache_scales)
    parsed = read_quant_config(dst, {"quantization_config": dict(qcfg, quant_method="modelopt")}
                               if fmt == "modelopt" else {"quantization_config": qcfg})
    # the on-disk weights to quantize: those of the model's linear projections, routed experts and
    # Zamba2 adapters (not the LM head, not routers), unless the config excludes them
    plan = tensor_plan(cfg)
    with torch.device("meta"):
        model = HybridModel(cfg)
    linear = {f"{n}.weight" for n, m in model.named_modules() if type(m) is Linear and n != "lm_head"}
    targets = set()
    for pname, s in plan.items():
        if pname in linear or pname.endswith(("experts.up", "experts.down", "_adapter.down", "_adapter.up")):
            targets |= {n for n in s.disk_names if parsed.scheme_for(n.removesuffix(".weight")) is not None}
    static = not dynamic
    amax, kv_amax = ({}, {})
    if static or kv_cache_scales:
        amax, kv_amax = calibrate(src, calibration_prompts, calibration_tokens, seed)

    os.makedirs(dst, exist_ok=True)
    files = weight_files(src)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)
    weight_map = {}
    for path, names in sorted(by_file.items()):
        out: dict[str, torch.Tensor] = {}
        with safe_open(path, framework="pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if name not in targets:
                    out[name] = t
                    continue
                module = name.removesuffix(".weight")
                scale_dtype = torch.float32 if fmt == "modelopt" else t.dtype
                q, scale = quantize_weight(t, per_channel, scale_dtype)
                if fmt == "modelopt" and t.dim() == 2:  # ModelOpt: [] per tensor, [out] per channel
                    scale = scale.reshape(-1) if per_channel else scale.reshape(())
                out[name], out[f"{module}.weight_scale"] = q, scale
                if static:
                    if module not in amax:
                        raise SystemExit(f"calibration never reached module {module}")
                    s = (amax[module] / FP8_MAX).clamp_min(1e-12)
                    out[f"{module}.input_scale"] = (s.reshape(()) if s.numel() == 1 else s).to(scale_dtype)
        if kv_cache_scales:
            for key, value in kv_amax.items():
                prefix, kind = key[:-1], key[-1]
                if prefix + f"{kind}_proj.weight" not in names:
                    continue
                name = f"{prefix}{kind}_proj.{kind}_scale" if fmt == "modelopt" else f"{prefix}{kind}_scale"
                out[name] = torch.tensor(max(value, 1e-12) / FP8_MAX, dtype=torch.float32)
        base = os.path.basename(path)
        save_file(out, os.path.join(dst, base), metadata={"format": "pt"})
        weight_map.update({n: base for n in out})
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        meta = read_json(index)
        meta["weight_map"] = dict(sorted(weight_map.items()))
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(meta, f, indent=2)
    for entry in os.listdir(src):
        if entry.endswith(".safetensors") or entry in ("model.safetensors.index.json", "config.json",
                                                       "hf_quant_config.json"):
            continue
        p = os.path.join(src, entry)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, entry))
    config = read_json(os.path.join(src, "config.json"))
    config.pop("quantization_config", None)
    if fmt == "modelopt" and modelopt_config == "hf_quant_config":
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(qcfg, f, indent=2)
    elif fmt == "modelopt":
        config["quantization_config"] = dict(qcfg, quant_method="modelopt")
    else:
        config["quantization_config"] = qcfg
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid.tools.quantize_fp8", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--format", required=True, choices=["modelopt", "compressed-tensors"])
    ap.add_argument("--per-channel", action="store_true", help="one weight scale per output row")
    ap.add_argument("--dynamic", action="store_true", help="activations quantized per token at run time")
    ap.add_argument("--exclude", action="append", default=[], help="more modules to keep unquantized")
    ap.add_argument("--modelopt-config", choices=["hf_quant_config", "config"], default="hf_quant_config",
                    help="ModelOpt: the config in hf_quant_config.json (default) or in config.json")
    ap.add_argument("--kv-cache-scales", action="store_true", help="also write FP8 KV-cache scales (k/v)")
    ap.add_argument("--calibration-prompts", type=int, default=8)
    ap.add_argument("--calibration-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    quantize_checkpoint(a.src, a.dst, a.format, per_channel=a.per_channel, dynamic=a.dynamic, exclude=a.exclude,
                        modelopt_config=a.modelopt_config, kv_cache_scales=a.kv_cache_scales,
                        calibration_prompts=a.calibration_prompts, calibration_tokens=a.calibration_tokens,
                        seed=a.seed)
    print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
