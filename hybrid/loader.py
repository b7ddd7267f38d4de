"""Checkpoint loading: on-disk (Hugging Face) tensor names -> the model's parameters.

Every family stores its tensors under its own names and layouts (NemotronH keeps MoE experts one
by one, Bamba splits gate and up projections, conv weights carry a singleton dim). `tensor_plan`
lists, for each model parameter, the on-disk tensors it is made of; loading checks the file set
against that plan, so a missing, unexpected or mis-shaped tensor is reported by its on-disk name.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from hybrid.config import ATTENTION, GATE_ONLY, HYBRID, MAMBA, MLP, MOE, ModelConfig, read_json
from hybrid.errors import CheckpointError
from hybrid.layers import Linear
from hybrid.model import HybridModel
from hybrid.fp8_linear import build_fp8_linear, check_scale, dequantize
from hybrid.quantization import FP8_STORED, plan_quantized, read_quant_config

logger = logging.getLogger("hybrid")

# Tensors some checkpoints carry that the runtime does not use.
_IGNORED = [
    re.compile(r"^mtp\."),  # NemotronH multi-token-prediction head
    re.compile(r".*rotary_emb\.inv_freq$"),
]


@dataclass
class Source:
    disk_names: list[str]
    how: str  # "whole" | "conv" (drop the singleton dim) | "stack" (experts) | "concat" (rows, e.g. gate|up)
    rows: tuple[int, ...] | None = None  # "concat": rows of each part (None: equal parts)
    # Per-row multipliers folded into the tensor (in fp32, before the cast to the model dtype):
    # Falcon-H1's muP multipliers of a projection's input or output sections
    row_scale: tuple[tuple[int, float], ...] | None = None  # (rows, multiplier) runs, in order
    # of those, the one applied to the projection's input (an FP8 checkpoint's input scale was
    # calibrated on the multiplied input; hybrid/quantization.py)
    input_multiplier: float = 1.0


def _mamba_sources(param_prefix: str, disk_prefix: str, cfg: ModelConfig) -> dict[str, Source]:
    m = cfg.mamba
    out = {
        "in_proj.weight": "in_proj.weight", "out_proj.weight": "out_proj.weight",
        "A_log": "A_log", "D": "D", "dt_bias": "dt_bias",
    }
    if m.gate != GATE_ONLY:
        out["norm_weight"] = "norm.weight"
    if m.proj_bias:
        out.update({"in_proj.bias": "in_proj.bias", "out_proj.bias": "out_proj.bias"})
    if m.conv_bias:
        out["conv_bias"] = "conv1d.bias"
    plan = {f"{param_prefix}{k}": Source([f"{disk_prefix}{v}"], "whole") for k, v in out.items()}
    plan[f"{param_prefix}conv_weight"] = Source([f"{disk_prefix}conv1d.weight"], "conv")
    return plan


def _attention_sources(param_prefix: str, disk_prefix: str, cfg: ModelConfig) -> dict[str, Source]:
    a = cfg.attention
    rows = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim)
    plan = {}
    for k in ["weight"] + (["bias"] if a.bias else []):
        # q, k and v projections as one GEMM
        plan[f"{param_prefix}qkv_proj.{k}"] = Source([f"{disk_prefix}{n}.{k}" for n in ("q_proj", "k_proj", "v_proj")],
                                                     "concat", rows)
        plan[f"{param_prefix}o_proj.{k}"] = Source([f"{disk_prefix}o_proj.{k}"], "whole")
    return plan


def tensor_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Model parameter name -> the on-disk tensors that make it."""
    plan: dict[str, Source] = {}
    if cfg.family == "falcon_h1":
        return _falcon_h1_plan(cfg)
    if cfg.family == "zamba2":
        return _zamba2_plan(cfg)
    if cfg.family == "nemotron_h":
        plan["embed"] = Source(["backbone.embeddings.weight"], "whole")
        plan["final_norm.weight"] = Source(["backbone.norm_f.weight"], "whole")
        for i, kind in enumerate(cfg.layer_types):
            p, d = f"layers.{i}.", f"backbone.layers.{i}."
            plan[f"{p}norm.weight"] = Source([f"{d}norm.weight"], "whole")
            if kind == MAMBA:
                plan.update(_mamba_sources(f"{p}mixer.", f"{d}mixer.", cfg))
            elif kind == ATTENTION:
                plan.update(_attention_sources(f"{p}mixer.", f"{d}mixer.", cfg))
            elif kind == MLP:
                for n in ("up_proj", "down_proj"):
                    plan[f"{p}mixer.{n}.weight"] = Source([f"{d}mixer.{n}.weight"], "whole")
            elif kind == MOE:
                e = range(cfg.moe.num_experts)
                plan[f"{p}mixer.router_weight"] = Source([f"{d}mixer.gate.weight"], "whole")
                plan[f"{p}mixer.router_bias"] = Source([f"{d}mixer.gate.e_score_correction_bias"], "whole")
                plan[f"{p}mixer.experts.up"] = Source([f"{d}mixer.experts.{j}.up_proj.weight" for j in e], "stack")
                plan[f"{p}mixer.experts.down"] = Source([f"{d}mixer.experts.{j}.down_proj.weight" for j in e], "stack")
                for n in ("up_proj", "down_proj"):
                    plan[f"{p}mixer.shared.{n}.weight"] = Source([f"{d}mixer.shared_experts.{n}.weight"], "whole")
    else:
        plan["embed"] = Source(["model.embed_tokens.weight"], "whole")
        final = "model.final_layernorm.weight" if cfg.family == "bamba" else "model.norm.weight"
        plan["final_norm.weight"] = Source([final], "whole")
        for i, kind in enumerate(cfg.layer_types):
            p, d = f"layers.{i}.", f"model.layers.{i}."
            plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
            if kind == MAMBA:
                plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba.", cfg))
            else:
                plan.update(_attention_sources(f"{p}mixer.", f"{d}self_attn.", cfg))
            if cfg.family == "bamba":
                plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
                plan[f"{p}mlp.gate_up_proj.weight"] = Source(
                    [f"{d}feed_forward.gate_proj.weight", f"{d}feed_forward.up_proj.weight"], "concat")
                plan[f"{p}mlp.down_proj.weight"] = Source([f"{d}feed_forward.down_proj.weight"], "whole")
            else:
                plan[f"{p}ffn_norm.weight"] = Source([f"{d}post_attention_layernorm.weight"], "whole")
                plan[f"{p}mlp.gate_up_proj.weight"] = Source([f"{d}shared_mlp.input_linear.weight"], "whole")
                plan[f"{p}mlp.down_proj.weight"] = Source([f"{d}shared_mlp.output_linear.weight"], "whole")
                if cfg.moe is not None:
                    plan[f"{p}moe.router_weight"] = Source([f"{d}block_sparse_moe.router.layer.weight"], "whole")
                    plan[f"{p}moe.experts.up"] = Source([f"{d}block_sparse_moe.input_linear.weight"], "whole")
                    plan[f"{p}moe.experts.down"] = Source([f"{d}block_sparse_moe.output_linear.weight"], "whole")
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


def _falcon_h1_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Falcon-H1: every layer has a Mamba2 mixer and attention in parallel, then a SwiGLU MLP. Its
    muP multipliers scale projections' inputs or output sections, so they fold into weight rows:
    in_proj(x * s_in) * [s_z|s_x|s_B|s_C|s_dt], k_proj(x * s_attn_in) * s_key, act(gate * s_gate), ..."""
    mup, m, a = cfg.mup, cfg.mamba, cfg.attention
    inner, gn, nh = m.intermediate_size, m.n_groups * m.state_size, m.num_heads
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    s_z, s_x, s_b, s_c, s_dt = mup.ssm_zxbcdt
    sections = ((inner, s_z), (inner, s_x), (gn, s_b), (gn, s_c), (nh, s_dt))
    # (weight runs, bias runs): a bias takes only the multipliers applied after the projection
    scales = {
        "mamba.in_proj": ([(n, v * mup.ssm_in) for n, v in sections], list(sections)),
        "mamba.out_proj": ([(cfg.hidden_size, mup.ssm_out)],) * 2,
        "attn.qkv_proj": ([(q, mup.attention_in), (kv, mup.attention_in * mup.key), (kv, mup.attention_in)],
                          [(q, 1.0), (kv, mup.key), (kv, 1.0)]),
        "attn.o_proj": ([(cfg.hidden_size, mup.attention_out)],) * 2,
        "mlp.gate_up_proj": ([(cfg.intermediate_size, mup.mlp_gate), (cfg.intermediate_size, 1.0)],) * 2,
        "mlp.down_proj": ([(cfg.hidden_size, mup.mlp_down)],) * 2,
    }
    plan = {"embed": Source(["model.embed_tokens.weight"], "whole"),
            "final_norm.weight": Source(["model.final_layernorm.weight"], "whole")}
    for i in range(cfg.num_layers):
        p, d = f"layers.{i}.", f"model.layers.{i}."
        plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
        plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
        plan.update(_mamba_sources(f"{p}mamba.", f"{d}mamba.", cfg))
        plan.update(_attention_sources(f"{p}attn.", f"{d}self_attn.", cfg))
        plan[f"{p}mlp.gate_up_proj.weight"] = Source(
            [f"{d}feed_forward.gate_proj.weight", f"{d}feed_forward.up_proj.weight"], "concat")
        plan[f"{p}mlp.down_proj.weight"] = Source([f"{d}feed_forward.down_proj.weight"], "whole")
        for name, (weight_runs, bias_runs) in scales.items():
            for leaf, runs in (("weight", weight_runs), ("bias", bias_runs)):
                src = plan.get(f"{p}{name}.{leaf}")
                if src is not None and any(v != 1.0 for _, v in runs):
                    src.row_scale = tuple(runs)
        plan[f"{p}mamba.in_proj.weight"].input_multiplier = mup.ssm_in
        plan[f"{p}attn.qkv_proj.weight"].input_multiplier = mup.attention_in
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


def _zamba2_plan(cfg: ModelConfig) -> dict[str, Source]:
    """Zamba2. Shared block k is stored once, under the k-th hybrid layer
    (`model.layers.{hybrid[k]}.shared_transformer.*`; the later layers' copies are tied to it and not
    saved). The adapters of hybrid layer j live inside the block it uses, at index j of its adapter
    lists (`...linear_q_adapter_list.{j}.{0: down, 1: up}`, `...gate_up_proj_adapter_list.{j}.*`)."""
    hybrid = [i for i, kind in enumerate(cfg.layer_types) if kind == HYBRID]
    n_shared = min(cfg.shared_blocks.num_mem_blocks, len(hybrid))
    bias = ["weight", "bias"] if cfg.mamba.proj_bias else ["weight"]  # add_bias_linear: the MLP too
    plan = {"embed": Source(["model.embed_tokens.weight"], "whole"),
            "final_norm.weight": Source(["model.final_layernorm.weight"], "whole")}
    for k in range(n_shared):
        p, d = f"shared_blocks.{k}.", f"model.layers.{hybrid[k]}.shared_transformer."
        plan[f"{p}input_norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
        plan[f"{p}ffn_norm.weight"] = Source([f"{d}pre_ff_layernorm.weight"], "whole")
        plan.update(_attention_sources(f"{p}attn.", f"{d}self_attn.", cfg))
        for leaf in bias:
            for n in ("gate_up_proj", "down_proj"):
                plan[f"{p}mlp.{n}.{leaf}"] = Source([f"{d}feed_forward.{n}.{leaf}"], "whole")
    j = 0
    for i, kind in enumerate(cfg.layer_types):
        p, d = f"layers.{i}.", f"model.layers.{i}."
        if kind == MAMBA:
            plan[f"{p}norm.weight"] = Source([f"{d}input_layernorm.weight"], "whole")
            plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba.", cfg))
            continue
        plan[f"{p}norm.weight"] = Source([f"{d}mamba_decoder.input_layernorm.weight"], "whole")
        plan.update(_mamba_sources(f"{p}mixer.", f"{d}mamba_decoder.mamba.", cfg))
        plan[f"{p}linear.weight"] = Source([f"{d}linear.weight"], "whole")
        src = f"model.layers.{hybrid[j % n_shared]}.shared_transformer."
        if cfg.shared_blocks.attention_adapters:
            lists = [f"{src}self_attn.linear_{n}_adapter_list.{j}" for n in "qkv"]
            plan[f"{p}qkv_adapter.down"] = Source([f"{a}.0.weight" for a in lists], "concat")
            plan[f"{p}qkv_adapter.up"] = Source([f"{a}.1.weight" for a in lists], "stack")
        mlp = f"{src}feed_forward.gate_up_proj_adapter_list.{j}"
        plan[f"{p}mlp_adapter.down"] = Source([f"{mlp}.0.weight"], "whole")
        plan[f"{p}mlp_adapter.up"] = Source([f"{mlp}.1.weight"], "stack")
        j += 1
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = Source(["lm_head.weight"], "whole")
    return plan


def _apply_row_scale(tensor: torch.Tensor, runs: tuple[tuple[int, float], ...], cut=None) -> torch.Tensor:
    """`cut`: a tensor-parallel shard along rows (dim 0) takes its rows' multipliers."""
    scale = torch.cat([torch.full((n,), v, dtype=torch.float32) for n, v in runs])
    if cut is not None and cut.dim == 0:
        scale = torch.cat([scale[a:b] for a, b in cut.ranges])
    scale = scale.to(tensor.device)
    if scale.shape[0] != tensor.shape[0]:
        raise AssertionError(f"row multipliers for {scale.shape[0]} rows, tensor has {tensor.shape[0]}")
    return tensor.float() * scale.view(-1, *([1] * (tensor.dim() - 1)))


def _disk_shapes(how: str, shape: torch.Size, count: int, rows: tuple[int, ...] | None = None) -> list[tuple[int, ...]]:
    if how == "whole":
        return [tuple(shape)]
    if how == "conv":
        return [(shape[0], 1, shape[1])]
    if how == "stack":
        return [tuple(shape[1:])] * count
    if how == "concat":
        return [(r, *shape[1:]) for r in rows] if rows else [(shape[0] // count, *shape[1:])] * count
    raise AssertionError(how)


def _open(path: str, device: str = "cpu"):
    """safe_open(path), with a broken file (empty, truncated, not safetensors) as a CheckpointError
    naming it. Opening reads and checks the header: every tensor's extent against the file size."""
    try:
        return safe_open(path, framework="pt", device=device)
    except Exception as e:  # SafetensorError, OSError, ...: the file, not the runtime, is at fault
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _shard_path(model_dir: str, index: str, shard) -> str:
    """The path of a shard named by the index: only a relative path that stays inside the checkpoint
    directory (checked on the name, before anything is opened). Symlinks inside the directory are
    followed as for model.safetensors itself: the Hugging Face cache links snapshot files to blobs."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map entries must be file names, got {shard!r}")
    norm = os.path.normpath(shard)
    if os.path.isabs(shard) or os.path.isabs(norm) or norm == os.curdir or norm.split(os.sep)[0] == os.pardir \
            or "\0" in shard or (os.altsep and os.altsep in shard) or os.path.splitdrive(shard)[0]:
        raise CheckpointError(f"{index}: weight_map names '{shard}', which is not a file inside the checkpoint "
                              "directory")
    return os.path.join(model_dir, norm)


def weight_files(model_dir: str) -> dict[str, str]:
    """On-disk tensor name -> the safetensors file holding it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        # every entry is checked before any file is opened
        paths = {name: _shard_path(model_dir, index, shard) for name, shard in weight_map.items()}
        files = {}
        shard_keys: dict[str, set[str]] = {}
        for name, path in paths.items():
            if path not in shard_keys:
                if not os.path.isfile(path):
                    raise CheckpointError(f"missing file: {path} (shard listed in model.safetensors.index.json)")
                with _open(path) as f:  # reads the header only
                    shard_keys[path] = set(f.keys())
            if name not in shard_keys[path]:
                raise CheckpointError(f"missing tensor '{name}': model.safetensors.index.json lists it in "
                                      f"{weight_map[name]}, which does not hold it")
            files[name] = path
        return files
    if os.path.isfile(single):
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"missing file: no model.safetensors or model.safetensors.index.json in {model_dir}")


# safetensors dtype names of floating-point weights; anything else (integers, bool, fp8 without its
# scales) would be converted silently into meaningless values.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


# Parameters computed in fp32 whatever the model dtype (NemotronH router, as in the reference).
_FP32_PARAMS = re.compile(r"mixer\.router_(weight|bias)$")


def _read_cut(info, how: str, cut, offset: int, rows: int) -> torch.Tensor:
    """A tensor-parallel shard of one on-disk part (a safetensors slice: only those bytes are read).
    `cut` is in the assembled parameter's coordinates; this part is its rows [offset, offset + rows)
    for "concat", one entry of the leading (expert) dim for "stack"."""
    dim = cut.dim - 1 if how == "stack" else cut.dim
    ranges = cut.ranges
    if how == "concat" and cut.dim == 0:  # the cut's rows that fall in this part, shifted to it
        ranges = [(max(a, offset) - offset, min(b, offset + rows) - offset) for a, b in ranges
                  if min(b, offset + rows) > max(a, offset)]
    index = [slice(None)] * dim
    pieces = [info[tuple(index + [slice(a, b)])] for a, b in ranges if b > a]
    if not pieces:  # a part with none of this rank's rows (vocab padding, a concat part)
        return info[tuple(index + [slice(0, 0)])]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def load_model(model_dir: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               progress: bool = False, check_finite: bool = False, shard=None) -> HybridModel:
    """The model with every parameter loaded from the checkpoint. CheckpointError, naming the file
    and the tensor, for a missing, unexpected, mis-shaped or non-float tensor or a broken file.
    `check_finite`: also refuse a tensor holding NaN or Inf, as loaded (one isfinite reduction per
    tensor on the load device; its startup cost on an 8B model was not measured here, having no GPU).
    Without it a non-finite weight is still caught when it reaches the logits (the engine fails
    the request; see Engine._finish_step).
    `shard` (tensor parallelism, hybrid/parallel/shard_model.py): builds the rank's model
    (`build()`), gives each parameter's full shape and Cut; each tensor is then read as that rank's
    slice only. None: the whole model, as always."""
    quant = read_quant_config(model_dir, cfg.raw)  # None: not a quantized checkpoint
    if shard is not None and quant is not None:
        from hybrid.errors import ConfigurationError

        raise ConfigurationError("tensor parallelism does not load quantized (FP8) checkpoints yet")
    model = HybridModel(cfg) if shard is None else shard.build()
    plan = tensor_plan(cfg)
    params = dict(model.named_parameters())
    if set(plan) != set(params):  # a bug in the plan, not in the checkpoint
        raise AssertionError(f"tensor plan and model disagree: {sorted(set(plan) ^ set(params))}")
    files = weight_files(model_dir)
    handles: dict[str, object] = {}

    def handle(name: str):
        path = files[name]
        if path not in handles:
            handles[path] = _open(path, str(device))
        return handles[path]

    def read(name: str) -> torch.Tensor:
        try:
            return handle(name).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{files[name]}: cannot read tensor '{name}': {e}") from None

    def stored_dtype(name: str) -> str:
        try:
            return handle(name).get_slice(name).get_dtype()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{files[name]}: cannot read tensor '{name}': {e}") from None

    qplan = None
    if quant is not None:
        linear = {f"{n}.weight" for n, m in model.named_modules() if type(m) is Linear and n != "lm_head"}
        qplan = plan_quantized(quant, plan, linear, files, stored_dtype)
        logger.info("%s", qplan.summary())
    wanted = {n for src in plan.values() for n in src.disk_names}
    if qplan is not None:
        wanted |= qplan.required
    if cfg.tie_word_embeddings:
        wanted_optional = {"lm_head.weight"}  # some tied checkpoints still store it
    else:
        wanted_optional = set()
    if cfg.family == "falcon_h1" and cfg.mamba.gate == GATE_ONLY:
        # without mamba_rms_norm transformers makes the norm an identity and ignores a stored weight
        wanted_optional |= {f"model.layers.{i}.mamba.norm.weight" for i in range(cfg.num_layers)}
    if qplan is not None:
        wanted_optional |= qplan.optional
    unexpected = sorted(n for n in files if n not in wanted and n not in wanted_optional
                        and not any(p.match(n) for p in _IGNORED))
    if unexpected:
        scales = quant is None and any(n.endswith((".weight_scale", ".input_scale")) for n in unexpected)
        raise CheckpointError(f"unexpected tensor '{unexpected[0]}' in checkpoint"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + ("; it holds quantization scales, but the checkpoint declares no quantization config "
                                 "(quantization_config in config.json, or hf_quant_config.json)" if scales else ""))
    missing = sorted(n for n in wanted if n not in files)
    if missing:
        raise CheckpointError(f"missing tensor '{missing[0]}' in checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    items = list(plan.items())
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc="Loading weights", unit="tensor")
    fp8_parts = []  # (param, source, fp8 parts) of the projections that become Fp8Linear
    for pname, src in items:
        target = params[pname]
        full = target.shape if shard is None else shard.full_shape(pname)
        cut = None if shard is None else shard.cut(pname)
        shapes = _disk_shapes(src.how, full, len(src.disk_names), src.rows)
        parts = []
        offset = 0  # "concat": the first row of this part in the assembled tensor
        for disk_name, shape in zip(src.disk_names, shapes):
            where = os.path.basename(files[disk_name])
            try:
                info = handle(disk_name).get_slice(disk_name)
                found, stored = tuple(info.get_shape()), info.get_dtype()
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{files[disk_name]}: cannot read tensor '{disk_name}': {e}") from None
            if found != shape:
                raise CheckpointError(f"shape mismatch for tensor '{disk_name}' in {where}: expected {list(shape)}, "
                                      f"found {list(found)}")
            fp8 = stored == FP8_STORED and qplan is not None and (pname in qplan.linear or disk_name in qplan.dequant)
            if stored not in _FLOAT_DTYPES and not fp8:
                raise CheckpointError(f"tensor '{disk_name}' in {where} is stored as {stored}: weights must be "
                                      f"floating point ({', '.join(_FLOAT_DTYPES)})"
                                      + ("" if not stored.startswith("F8") else
                                         " or FP8 with their scales in a quantized checkpoint (no quantization_config "
                                         "in config.json, no hf_quant_config.json)" if qplan is None else
                                         "; FP8 weights must be float8_e4m3fn (F8_E4M3)"))
            if cut is None:
                part = read(disk_name)
            else:
                part = _read_cut(info, src.how, cut, offset, shape[0]).to(device)
            offset += shape[0]
            if check_finite and not bool(torch.isfinite(part.float() if fp8 else part).all()):
                raise CheckpointError(f"tensor '{disk_name}' in {where} holds non-finite values (NaN or Inf)")
            if fp8 and disk_name in qplan.dequant:  # experts, routers, adapters, LM head: dequantized at load
                q = qplan.dequant[disk_name]
                experts = part.shape[0] if part.dim() == 3 else None
                scale = check_scale(read(q.scale), q.scale, stored_dtype(q.scale), rows=part.shape[-2], experts=experts)
                part = dequantize(part, scale)
            parts.append(part)
        if qplan is not None and pname in qplan.linear:
            fp8_parts.append((pname, src, parts))
            continue
        if src.how == "whole":
            tensor = parts[0]
        elif src.how == "conv":
            tensor = parts[0].squeeze(1)
        elif src.how == "stack":
            tensor = torch.stack(parts)
        else:
            tensor = torch.cat(parts, dim=0)
        del parts
        if src.row_scale is not None:
            tensor = _apply_row_scale(tensor, src.row_scale, cut)
        if cut is not None and tensor.shape[cut.dim] < cut.rows:  # vocab rows past the end: zeros
            pad = list(tensor.shape)
            pad[cut.dim] = cut.rows - tensor.shape[cut.dim]
            tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=cut.dim)
        want_dtype = torch.float32 if _FP32_PARAMS.search(pname) else dtype
        tensor = tensor.to(device=device, dtype=want_dtype).contiguous()
        _set_param(model, pname, tensor)
    for pname, src, parts in fp8_parts:  # after the loop: their biases are loaded by now
        _set_fp8_linear(model, qplan.linear[pname], src, parts, read, stored_dtype)
    handles.clear()
    _move_buffers(model, device)
    return model


def _set_fp8_linear(model: torch.nn.Module, param, src: Source, weights: list[torch.Tensor], read,
                    stored_dtype) -> None:
    """Replace the Linear `param.module` by the Fp8Linear of its on-disk FP8 parts and their scales."""
    scales, inputs = [], []
    for part, w in zip(param.parts, weights):
        scales.append(check_scale(read(part.scale), part.scale, stored_dtype(part.scale), rows=w.shape[0]))
        inputs.append(check_scale(read(part.input_scale), part.input_scale, stored_dtype(part.input_scale))
                      if part.input_scale else None)
    row_scale = None
    if src.row_scale is not None:
        row_scale = torch.cat([torch.full((n,), v, dtype=torch.float32) for n, v in src.row_scale])
    parent_name, _, attr = param.module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    bias = old.bias.data if old.bias is not None else None
    setattr(parent, attr, build_fp8_linear(param, weights, scales, inputs, bias, row_scale, src.input_multiplier))


def _set_param(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for bname, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[bname] = buf.to(device)
