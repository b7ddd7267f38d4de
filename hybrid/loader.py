"""Checkpoint loading: the safetensors files read into the model's parameters.

What each parameter is made of on disk is the tensor plan (hybrid/tensor_plan.py); loading checks
the checkpoint's files (its index, `weight_files`) against that plan, so a missing, unexpected or
mis-shaped tensor is reported by its on-disk name, then assembles each parameter from its parts:
as a tensor-parallel rank's slice when sharded, FP8 projections as Fp8Linear (hybrid/quantization.py,
hybrid/fp8_linear.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re

import torch
from safetensors import safe_open

from hybrid.config import GATE_ONLY, ModelConfig
from hybrid.config_fields import read_json
from hybrid.errors import CheckpointError
from hybrid.layers import Linear
from hybrid.load_prefetch import Prefetcher, prefetch_enabled
from hybrid.model import HybridModel
from hybrid.fp8_linear import (
    FP8_EXPERT_PARAMS, build_fp8_linear, check_scale, dequantize, keep_fp8_experts, row_scales, settle_fp8_experts,
)
from hybrid.quantization import FP8_DTYPE, FP8_STORED, plan_quantized, read_quant_config
from hybrid.tensor_plan import Source, checkpoint_plan

logger = logging.getLogger("hybrid")

# Tensors some checkpoints carry that the runtime does not use.
_IGNORED = [
    re.compile(r"^mtp\."),  # NemotronH multi-token-prediction head
    re.compile(r".*rotary_emb\.inv_freq$"),
]


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


_ZAMBA2_ADAPTER = re.compile(r"^model\.layers\.\d+\.shared_transformer\..*_adapter_list\.\d+\.[01]\.weight$")

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
    files = weight_files(model_dir)
    plan = checkpoint_plan(cfg, files)  # (the released names, or transformers' in-memory ones)
    params = dict(model.named_parameters())
    if set(plan) != set(params):  # a bug in the plan, not in the checkpoint
        raise AssertionError(f"tensor plan and model disagree: {sorted(set(plan) ^ set(params))}")
    handles: dict[str, object] = {}

    def handle(name: str):
        path = files[name]
        if path not in handles:
            handles[path] = _open(path, str(device))
        return handles[path]

    prefetch = None  # (set below, for the parameters' loop)

    def read(name: str) -> torch.Tensor:
        if prefetch is not None:
            tensor = prefetch.take(name)
            if tensor is not None:
                return tensor
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
    if cfg.family == "granitemoehybrid" and cfg.intermediate_size == 0:
        # shared_intermediate_size 0: transformers saves the zero-width shared MLP's empty tensors
        wanted_optional |= {f"model.layers.{i}.shared_mlp.{n}.weight" for i in range(cfg.num_layers)
                            for n in ("input_linear", "output_linear")}
    if cfg.shared_blocks is not None and not cfg.shared_blocks.tied:
        # untied Zamba2 blocks each hold the adapters of every hybrid layer of their block id, and use only
        # their own layer's (transformers' adapter lists)
        wanted_optional |= {n for n in files if _ZAMBA2_ADAPTER.match(n)}
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
    # (prefetch: each tensor's bytes read on a thread ahead of this loop, in its order; hybrid/load_prefetch.py)
    prefetch = (Prefetcher(files, [d for _, src in plan.items() for d in src.disk_names], device)
                if shard is None and prefetch_enabled() else None)
    with prefetch if prefetch is not None else contextlib.nullcontext():
        fp8_parts = []  # (param, source, fp8 parts) of the projections that become Fp8Linear
        keep_experts = qplan is not None and shard is None and keep_fp8_experts(device)
        for pname, src in items:
            target = params[pname]
            full = target.shape if shard is None else shard.full_shape(pname)
            cut = None if shard is None else shard.cut(pname)
            shapes = _disk_shapes(src.how, full, len(src.disk_names), src.rows)
            parts = []
            # FP8 routed experts kept as stored (hybrid/moe.py): each part's row scales. plan_quantized
            # refuses a parameter whose parts mix FP8 and float, so its parts are all kept or none
            keep_fp8 = keep_experts and pname.endswith(FP8_EXPERT_PARAMS) and src.row_scale is None
            fp8_scales = []
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
                    if keep_fp8:
                        fp8_scales.append(row_scales(part, scale))
                    else:
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
            if tensor.dtype == FP8_DTYPE:  # FP8 experts, kept as stored with one scale per row (hybrid/moe.py)
                want_dtype = FP8_DTYPE
                scales = fp8_scales[0] if src.how == "whole" else torch.stack(fp8_scales) if src.how == "stack" \
                    else torch.cat(fp8_scales)
                _set_param(model, f"{pname}_scale", scales.to(device).contiguous(), buffer=True)
            tensor = tensor.to(device=device, dtype=want_dtype).contiguous()
            _set_param(model, pname, tensor)
    for pname, src, parts in fp8_parts:  # after the loop: their biases are loaded by now
        _set_fp8_linear(model, qplan.linear[pname], src, parts, read, stored_dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        _untie_differing_lm_head(model, "lm_head.weight", read, stored_dtype("lm_head.weight"), device,
                                 None if shard is None else shard.cut("embed"), check_finite, files["lm_head.weight"])
    handles.clear()
    if keep_experts and settle_fp8_experts(model, dtype):
        logger.info("FP8 routed experts kept in FP8 (weight-only, dequantized inside the fused MoE kernel)")
    _move_buffers(model, device)
    return model


def _untie_differing_lm_head(model: HybridModel, name: str, read, stored: str, device: torch.device, cut,
                             check_finite: bool, path: str) -> None:
    """A tied checkpoint that stores lm_head.weight with values of its own: transformers then does not
    tie (it warns and keeps both), so the logits come from the stored head, not the embeddings.
    `cut` (tensor parallelism): the rank's vocab rows of the embedding, which its head takes too."""
    if stored not in _FLOAT_DTYPES:  # e.g. an FP8 head: no format this loader knows quantizes the LM head
        raise CheckpointError(f"{path}: tensor '{name}' of a tied checkpoint is stored as {stored}: an LM head "
                              f"must be floating point ({', '.join(_FLOAT_DTYPES)})")
    embed = model.embed
    head = read(name)
    full_rows = embed.shape[0] if cut is None else getattr(model, "full_vocab_size", embed.shape[0])
    if tuple(head.shape) != (full_rows, embed.shape[1]):
        raise CheckpointError(f"shape mismatch for tensor '{name}': expected {[full_rows, embed.shape[1]]}, "
                              f"found {list(head.shape)}")
    if cut is not None:  # this rank's rows, zero-padded as its embedding is
        local = torch.zeros(embed.shape, dtype=head.dtype)
        at = 0
        for a, b in cut.ranges:
            local[at:at + b - a] = head[a:b]
            at += b - a
        head = local
    head = head.to(device=device, dtype=embed.dtype)
    if torch.equal(head, embed):
        return
    if check_finite and not torch.isfinite(head).all():
        raise CheckpointError(f"{path}: tensor '{name}' holds non-finite values")
    logger.warning("tie_word_embeddings is set but lm_head.weight differs from the embeddings: not tied "
                   "(as transformers)")
    lm_head = Linear(embed.shape[1], embed.shape[0], bias=False, role="lm_head")
    lm_head.weight = torch.nn.Parameter(head.contiguous(), requires_grad=False)
    model.lm_head = lm_head


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


def _set_param(model: torch.nn.Module, name: str, tensor: torch.Tensor, buffer: bool = False) -> None:
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, attr, tensor if buffer else torch.nn.Parameter(tensor, requires_grad=False))


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for bname, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[bname] = buf.to(device)
