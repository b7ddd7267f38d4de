"""FP8 (e4m3) checkpoints: the two common formats' configs, the load plan, and the FP8 linear layer.

Formats (README "Quantized checkpoints" has the full notes, with where each fact comes from):

* NVIDIA ModelOpt: `quantization_config` in config.json with `quant_method: "modelopt"` (the algo at
  the top level, or nested under `quantization` as in hf_quant_config.json), or a separate
  `hf_quant_config.json` `{"producer": ..., "quantization": {"quant_algo", "kv_cache_quant_algo",
  "exclude_modules"}}`. `FP8`: per-tensor weight scale and a static per-tensor input scale;
  `FP8_PER_CHANNEL_PER_TOKEN`: per-output-channel weight scale, activations quantized per token at
  run time. `exclude_modules` are wildcards (fnmatch) over module names.
* compressed-tensors (llm-compressor): `quant_method: "compressed-tensors"`, `format`
  "float-quantized" / "naive-quantized", `config_groups` of {`targets`, `weights`,
  `input_activations`}, an `ignore` list (names, or `re:` regexes matched from the start).

Tensors of a quantized module `m`: `m.weight` float8_e4m3fn [out, in], `m.weight_scale` (one value,
or one per output row: [out] or [out, 1]), `m.input_scale` (one value, static activations only).
Attention modules may carry KV-cache scales (`k_scale`, `v_scale`, ...): read past here; the FP8 KV
cache (hybrid/kv_cache_dtype.py, kv_cache_dtype="fp8") reads them, otherwise the KV
cache stays in the model dtype.

What the runtime does with them: the projections that are `Linear` modules of the model become
`Fp8Linear` (the fp8 weight stays resident, 1 byte a value); the other linear-shaped weights an FP8
checkpoint may quantize (routed experts, routers, Zamba2's adapters, an untied LM head) are
dequantized to the model dtype at load, except the routed experts on CUDA, which stay in FP8 with
per-row scales for the fused MoE kernel (hybrid/fp8_linear.keep_fp8_experts, hybrid/moe.py Experts).
Embeddings, norms, conv1d, A_log / D / dt_bias and biases are never FP8: such a tensor stored in
FP8 is a CheckpointError, as is an FP8 weight without its scale or one the config excludes.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hybrid.errors import CheckpointError

logger = logging.getLogger("hybrid")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# floor of a dynamic per-token scale (vLLM's per-token quantization uses the same floor), so an
# all-zero row (a padding token) divides by a positive number
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)
FP8_STORED = "F8_E4M3"  # the safetensors dtype name of float8_e4m3fn
_SCALE_DTYPES = ("F32", "BF16", "F16", "F64")

STATIC, DYNAMIC = "static", "dynamic"  # activation quantization: per-tensor input_scale | per token at run time
TENSOR, CHANNEL = "tensor", "channel"  # weight scale granularity


@dataclass(frozen=True)
class Scheme:
    weight: str  # TENSOR | CHANNEL (what the config says; the stored scale's shape decides per module)
    activation: str | None  # STATIC | DYNAMIC | None (weights only)


def _fail(where: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{where}: {msg}")


# ---------------------------------------------------------------------------------------------
# quantization configs
# ---------------------------------------------------------------------------------------------


@dataclass
class QuantConfig:
    method: str  # "modelopt" | "compressed-tensors"
    where: str  # the file (and key) it was read from, for messages
    algo: str  # "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "compressed-tensors float-quantized", ...
    kv_cache: str | None = None  # declared KV-cache quantization (its scales are read past)
    exclude: list[str] = field(default_factory=list)  # modelopt exclude_modules / compressed-tensors ignore
    scheme: Scheme | None = None  # modelopt: one scheme for every module not excluded
    groups: list[tuple[list[str], Scheme]] = field(default_factory=list)  # compressed-tensors (targets, scheme)

    def describe(self) -> str:
        return f"{self.method} {self.algo}" if self.method == "modelopt" else self.algo

    def exclusion(self, module: str) -> str | None:
        """The exclude / ignore entry that leaves `module` (an on-disk module name) unquantized."""
        for pat in self.exclude:
            if self.method == "modelopt":
                # wildcards over module names (a trailing `name*` covers the module and its children);
                # a plain name also matches as a dotted part of the module path (older ModelOpt
                # exports list e.g. "lm_head" for "model.lm_head", as vLLM's loader accepts)
                if fnmatch.fnmatchcase(module, pat) or module == pat:
                    return pat
                if not any(c in pat for c in "*?[") and (module.endswith("." + pat) or f".{pat}." in module
                                                         or module.startswith(pat + ".")):
                    return pat
            elif _ct_match(module, pat):
                return pat
        return None

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme the config gives `module` (a linear-shaped on-disk module), None if it leaves it
        unquantized."""
        if self.exclusion(module) is not None:
            return None
        if self.method == "modelopt":
            return self.scheme
        for targets, scheme in self.groups:
            for t in targets:
                # a layer name, a `re:` regex, or a module class: every module this can hold in FP8
                # is an nn.Linear in transformers (or a stack of them), so class targets are
                # those "Linear" contains (matched like vLLM: case-insensitive substring)
                if _ct_match(module, t) or (not t.startswith("re:") and t.lower() in "linear"):
                    return scheme
        return None


def _ct_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target


def read_quant_config(model_dir: str, raw: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's quantization config (config.json `quantization_config`, else
    hf_quant_config.json), None for an unquantized checkpoint. CheckpointError for a format, algo or
    scheme this runtime does not load, naming what was found."""
    from hybrid.config_fields import read_json

    qc = raw.get("quantization_config")
    where = os.path.join(model_dir, "config.json") + " quantization_config"
    if qc is None:
        path = os.path.join(model_dir, "hf_quant_config.json")
        if not os.path.isfile(path):
            return None
        qc, where = read_json(path), path
        if not isinstance(qc, dict):
            raise _fail(where, "must hold a JSON object")
        qc = dict(qc)
        qc.setdefault("quant_method", "modelopt")  # the file is ModelOpt's own
    if not isinstance(qc, dict):
        raise _fail(where, f"must be a JSON object, found {qc!r}")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise _fail(where, f"has no quant_method (found {method!r}); supported: 'modelopt' (FP8, "
                           "FP8_PER_CHANNEL_PER_TOKEN) and 'compressed-tensors' (FP8)")
    if method.lower().startswith("modelopt"):
        return _modelopt(qc, where)
    if method.lower() == "compressed-tensors":
        return _compressed_tensors(qc, where)
    raise _fail(where, f"quant_method '{method}' is not supported; supported: 'modelopt' (FP8, "
                       "FP8_PER_CHANNEL_PER_TOKEN) and 'compressed-tensors' (FP8 weights, float-quantized)")


_MODELOPT_SCHEMES = {"FP8": Scheme(TENSOR, STATIC), "FP8_PER_CHANNEL_PER_TOKEN": Scheme(CHANNEL, DYNAMIC)}


def _modelopt(qc: dict[str, Any], where: str) -> QuantConfig:
    body = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = body.get("quant_algo")
    if not isinstance(algo, str) or not algo:
        raise _fail(where, f"ModelOpt config without quant_algo (found {algo!r})")
    scheme = _MODELOPT_SCHEMES.get(algo.upper())
    if scheme is None:
        raise _fail(where, f"ModelOpt quant_algo '{algo}' is not supported; supported: "
                           f"{', '.join(_MODELOPT_SCHEMES)} (block-wise FP8_PB_WO, NVFP4, MXFP8, INT4/INT8 "
                           "and MIXED_PRECISION are not)")
    if "exclude_modules" in body:
        exclude = body["exclude_modules"]
    else:  # the compressed-tensors-style spelling some exports put into config.json
        exclude = body.get("ignore", [])
    exclude = [] if exclude is None else exclude
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise _fail(where, f"exclude_modules must be a list of strings, found {exclude!r}")
    kv = body.get("kv_cache_quant_algo")
    if kv is None and isinstance(body.get("kv_cache_scheme"), dict):
        kv = _ct_kv_scheme(body["kv_cache_scheme"], where)
    if kv is not None and (not isinstance(kv, str) or kv.upper() != "FP8"):
        raise _fail(where, f"kv_cache_quant_algo '{kv}' is not supported (FP8 or none; the KV cache stays in "
                           "the model dtype either way)")
    return QuantConfig("modelopt", where, algo.upper(), kv_cache=kv.upper() if kv else None, exclude=list(exclude),
                       scheme=scheme)


_CT_FORMATS = ("float-quantized", "naive-quantized")


def _ct_kv_scheme(kv: Any, where: str) -> str | None:
    if kv is None:
        return None
    if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float":
        return "FP8"
    raise _fail(where, f"kv_cache_scheme {kv!r} is not supported (8-bit float or none)")


def _ct_args(args: Any, what: str, group: str, where: str) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise _fail(where, f"config_groups.{group}.{what} must be an object, found {args!r}")
    bits, kind = args.get("num_bits"), args.get("type", "int")
    if bits != 8 or kind != "float":
        raise _fail(where, f"config_groups.{group}.{what} is num_bits={bits}, type={kind!r}: only 8-bit float "
                           "(FP8 e4m3) is supported (int8, int4 / W4A16, NVFP4, MXFP4 are not)")
    if args.get("symmetric", True) is not True:
        raise _fail(where, f"config_groups.{group}.{what} is asymmetric (zero points): not supported")
    return args


def _compressed_tensors(qc: dict[str, Any], where: str) -> QuantConfig:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise _fail(where, f"compressed-tensors format {fmt!r} is not supported; supported: "
                           f"{', '.join(_CT_FORMATS)} (FP8 weights stored as float8_e4m3fn)")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _fail(where, f"compressed-tensors {key} is not supported")
    groups_raw = qc.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise _fail(where, f"compressed-tensors config without config_groups (found {groups_raw!r})")
    groups = []
    for gname, g in groups_raw.items():
        if not isinstance(g, dict):
            raise _fail(where, f"config_groups.{gname} must be an object")
        gfmt = g.get("format")
        if gfmt is not None and gfmt not in _CT_FORMATS:
            raise _fail(where, f"config_groups.{gname}.format {gfmt!r} is not supported ({', '.join(_CT_FORMATS)})")
        targets = g.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise _fail(where, f"config_groups.{gname}.targets must be a non-empty list of strings, found {targets!r}")
        w = _ct_args(g.get("weights"), "weights", gname, where)
        strategy = w.get("strategy", TENSOR)
        if strategy not in (TENSOR, CHANNEL) or w.get("dynamic", False):
            raise _fail(where, f"config_groups.{gname}.weights strategy {strategy!r}"
                               f"{' (dynamic)' if w.get('dynamic') else ''} is not supported: static per-tensor "
                               "or per-channel FP8 weights only (block-wise / group FP8 is not)")
        act = None
        a = g.get("input_activations")
        if a is not None:
            a = _ct_args(a, "input_activations", gname, where)
            a_strategy, dynamic = a.get("strategy", TENSOR), a.get("dynamic", False)
            if dynamic is True and a_strategy in (TENSOR, "token"):
                act = DYNAMIC  # quantized per token at run time (vLLM does so for dynamic per-tensor too)
            elif dynamic is False and a_strategy == TENSOR:
                act = STATIC
            else:
                raise _fail(where, f"config_groups.{gname}.input_activations strategy {a_strategy!r} with "
                                   f"dynamic={dynamic!r} is not supported (static per-tensor, or dynamic per token)")
        if g.get("output_activations") is not None:
            raise _fail(where, f"config_groups.{gname}.output_activations (quantized outputs) are not supported")
        groups.append((list(targets), Scheme(strategy, act)))
    ignore = qc.get("ignore", []) or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise _fail(where, f"ignore must be a list of strings, found {ignore!r}")
    kv = _ct_kv_scheme(qc.get("kv_cache_scheme"), where)
    return QuantConfig("compressed-tensors", where, f"compressed-tensors {fmt}", kv_cache=kv, exclude=list(ignore),
                       groups=groups)


# ---------------------------------------------------------------------------------------------
# the load plan
# ---------------------------------------------------------------------------------------------

# model parameters whose on-disk tensors are linear-shaped weights an FP8 checkpoint may quantize and
# that the runtime dequantizes at load (all other non-Linear parameters are never FP8)
_DEQUANT_PARAMS = re.compile(r"(experts\.(up|down)|router_weight|_adapter\.(down|up)|^lm_head\.weight)$")
# KV-cache scales on an attention module (ModelOpt: k_proj.k_scale / v_proj.v_scale; compressed-tensors:
# self_attn.k_scale / v_scale, older exports k_proj.output_scale / v_proj.output_scale)
# the names of an attention module's K and V scales, in order of preference (the FP8 KV cache reads them:
# hybrid/kv_cache_dtype.py)
K_SCALE_LEAVES = ("k_proj.k_scale", "k_scale", "kv_scale", "k_proj.output_scale")
V_SCALE_LEAVES = ("v_proj.v_scale", "v_scale", "kv_scale", "v_proj.output_scale")
_KV_SCALE_LEAVES = tuple(dict.fromkeys(K_SCALE_LEAVES + V_SCALE_LEAVES
                                       + ("q_scale", "prob_scale", "q_proj.output_scale")))


@dataclass
class Fp8Part:
    weight: str  # on-disk name of the fp8 weight
    scale: str  # ... of its weight_scale
    input_scale: str | None  # ... of its input_scale (static activations), if present


@dataclass
class Fp8Param:
    module: str  # the model's Linear module that becomes an Fp8Linear
    parts: list[Fp8Part]
    scheme: Scheme


@dataclass
class QuantPlan:
    config: QuantConfig
    linear: dict[str, Fp8Param] = field(default_factory=dict)  # model weight param -> its FP8 parts
    dequant: dict[str, Fp8Part] = field(default_factory=dict)  # on-disk fp8 weight -> its scales (dequantized at load)
    required: set[str] = field(default_factory=set)  # scale tensors the load reads
    optional: set[str] = field(default_factory=set)  # tensors read past (KV scales, unused input scales)

    def summary(self) -> str:
        n = len(self.linear)
        return (f"{self.config.describe()} checkpoint: {n} projection{'s' * (n != 1)} in FP8"
                + (f", {len(self.dequant)} other FP8 tensors (experts, routers, adapters, LM head): the routed "
                   f"experts kept in FP8 on CUDA, the rest dequantized at load"
                   if self.dequant else "")
                + (f"; KV-cache quantization {self.config.kv_cache} declared: its K/V scales are used with "
                   f"kv_cache_dtype='fp8' (otherwise the KV cache is in the model dtype)"
                   if self.config.kv_cache else ""))


def _module_of(disk_name: str, where: str) -> str:
    if not disk_name.endswith(".weight"):
        raise CheckpointError(f"tensor '{disk_name}' in {where} is stored as FP8 ({FP8_STORED}), but only "
                              "'<module>.weight' tensors of linear projections can be")
    return disk_name[: -len(".weight")]


def plan_quantized(qc: QuantConfig, plan: dict, linear_params: set[str], files: dict[str, str],
                   stored_dtype: Callable[[str], str]) -> QuantPlan:
    """Which model parameters load from FP8 tensors, and the scale tensors they need. `plan`: the
    tensor plan (hybrid/tensor_plan.py: model parameter -> Source); `linear_params`: the weight
    parameters of the model's Linear modules (not the LM head); `stored_dtype(name)`: a present
    tensor's safetensors dtype. CheckpointError, naming the tensor, for an FP8 tensor where none can
    be, one the config excludes or does not target, a missing scale, or a projection whose parts mix
    FP8 and float."""
    out = QuantPlan(qc)

    def where(name: str) -> str:
        return os.path.basename(files[name])

    def part_for(name: str, scheme: Scheme, linear: bool) -> Fp8Part:
        module = _module_of(name, where(name))
        scale, inp = f"{module}.weight_scale", f"{module}.input_scale"
        if scale not in files:
            raise CheckpointError(f"missing tensor '{scale}': the FP8 weight '{name}' ({where(name)}) needs its "
                                  f"weight_scale ({qc.describe()})")
        out.required.add(scale)
        if scheme.activation == STATIC:
            if inp not in files:
                if linear:
                    raise CheckpointError(f"missing tensor '{inp}': the FP8 weight '{name}' ({where(name)}) needs "
                                          f"its static input_scale ({qc.describe()})")
                inp = None
            else:
                (out.required if linear else out.optional).add(inp)
        else:
            inp = None  # (an input_scale under a dynamic scheme is reported as an unexpected tensor)
        return Fp8Part(name, scale, inp)

    for pname, src in plan.items():
        present = [n for n in src.disk_names if n in files]
        fp8 = [n for n in present if stored_dtype(n).startswith("F8")]
        if not fp8:
            continue
        other = next((n for n in fp8 if stored_dtype(n) != FP8_STORED), None)
        if other is not None:
            raise CheckpointError(f"tensor '{other}' in {where(other)} is stored as {stored_dtype(other)}: FP8 weights "
                                  f"must be float8_e4m3fn ({FP8_STORED})")
        linear, dequant = pname in linear_params, bool(_DEQUANT_PARAMS.search(pname))
        if not (linear or dequant):
            raise CheckpointError(f"tensor '{fp8[0]}' in {where(fp8[0])} is stored as FP8 ({FP8_STORED}), but "
                                  f"this tensor is never quantized (only linear projection weights are; "
                                  "embeddings, norms, conv1d, A_log, D, dt_bias and biases stay in float)")
        if len(fp8) != len(present):
            plain = next(n for n in present if n not in fp8)
            raise CheckpointError(f"tensors '{fp8[0]}' (FP8) and '{plain}' ({stored_dtype(plain)}) form one "
                                  "projection here and must be quantized alike")
        schemes = []
        for n in fp8:
            module = _module_of(n, where(n))
            entry = qc.exclusion(module)
            if entry is not None:
                raise CheckpointError(f"tensor '{n}' in {where(n)} is stored as FP8, but the quantization config "
                                      f"({qc.where}) excludes module '{module}' (entry '{entry}')")
            scheme = qc.scheme_for(module)
            if scheme is None:
                raise CheckpointError(f"tensor '{n}' in {where(n)} is stored as FP8, but no config_groups target "
                                      f"of {qc.where} covers module '{module}'")
            schemes.append(scheme)
        if linear:
            acts = {s.activation for s in schemes}
            if len(acts) > 1:
                raise CheckpointError(f"tensors {fp8} form one projection but quantize their inputs differently "
                                      f"({sorted(map(str, acts))})")
            out.linear[pname] = Fp8Param(pname.rpartition(".")[0], [part_for(n, s, True) for n, s in zip(fp8, schemes)],
                                         schemes[0])
        else:
            for n, s in zip(fp8, schemes):
                out.dequant[n] = part_for(n, s, False)
    # KV-cache scales on the attention modules (the prefix of every q/k/v projection)
    prefixes = {n.rsplit(".", 2)[0] + "." for src in plan.values() for n in src.disk_names
                if re.search(r"\.[qkv]_proj\.weight$", n)}
    out.optional |= {p + leaf for p in prefixes for leaf in _KV_SCALE_LEAVES if p + leaf in files}
    if not out.linear and not out.dequant:
        logger.warning("%s declares %s quantization but no weight is stored in FP8: loading the float weights",
                       qc.where, qc.describe())
    return out


# vLLM's quantization names that this runtime honours: it loads FP8 checkpoints in two formats, and
# "fp8" agrees with either of them
QUANTIZATION_NAMES = ("fp8", "modelopt", "compressed-tensors")


# what check_quantization_name says of quantization="fp8" on a checkpoint that is not quantized (hybrid/online_fp8.py)
ONLINE_FP8 = ("not quantized: its projections and routed experts are quantized to FP8 at load (per-channel weight "
              "scales, dynamic per-token activations; the LM head, embeddings, norms and routers stay as they are)")


def quantizes_at_load(name: str | None, model_dir: str, raw: dict[str, Any]) -> bool:
    """Whether vLLM's `quantization=NAME` asks for FP8 at load (hybrid/online_fp8.py): "fp8" for a checkpoint that
    is not quantized (check_quantization_name says what else it may be)."""
    return name is not None and str(name).strip().lower() == "fp8" and read_quant_config(model_dir, raw) is None


def check_quantization_name(name: str, model_dir: str, raw: dict[str, Any]) -> str:
    """vLLM's `quantization=NAME` against the checkpoint (its config.json `raw`): it must name the
    checkpoint's own format, or "fp8" (every format loaded here is FP8; on a checkpoint that is not
    quantized, "fp8" quantizes it at load: quantizes_at_load). Returns the checkpoint's quantization,
    described; ConfigurationError otherwise."""
    from hybrid.errors import ConfigurationError

    supported = ", ".join(QUANTIZATION_NAMES)
    given, name = name, str(name).strip().lower().replace("_", "-")  # compressed_tensors: the same name
    if name not in QUANTIZATION_NAMES:
        raise ConfigurationError(
            f"--quantization {given}: not supported; this runtime loads FP8 checkpoints in the ModelOpt and "
            f"compressed-tensors formats ({supported}; leave it out and the checkpoint's own format is used)")
    quant = read_quant_config(model_dir, raw)  # CheckpointError for formats not loaded here
    if quant is None:
        if name == "fp8":
            return ONLINE_FP8
        raise ConfigurationError(
            f"--quantization {name}: the checkpoint {model_dir} is not quantized (no quantization_config in "
            f"config.json, no hf_quant_config.json); {name} names a checkpoint format. Pass --quantization fp8 "
            "to quantize it to FP8 at load, leave it out to serve it as it is, or make an FP8 checkpoint of it: "
            "python -m hybrid.tools.quantize_fp8 SRC DST --format modelopt")
    if name not in ("fp8", quant.method):
        raise ConfigurationError(
            f"--quantization {name}: the checkpoint is {quant.describe()} ({quant.where}); pass --quantization "
            f"{quant.method} or leave it out")
    return quant.describe()
