"""Reading config.json: the file itself (either spelling of infinity) and its fields, each checked for
its type and range, with errors that name the key (hybrid/config_parse.py maps the fields onto ModelConfig)."""
from __future__ import annotations

import json
import math
import os
from typing import Any

from hybrid.errors import CheckpointError


def _decode_infinity(value: Any) -> Any:
    """config.json may spell infinity as the JSON extension `Infinity` or as {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            try:
                return float(value["__float__"])
            except (TypeError, ValueError):
                raise CheckpointError(f"unreadable number {value!r}") from None
        return {k: _decode_infinity(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_infinity(v) for v in value]
    return value


def read_json(path: str) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError naming the file if it is missing, not UTF-8, not
    JSON or not an object."""
    if not os.path.isfile(path):
        raise CheckpointError(f"missing file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            # Python's json accepts the Infinity/NaN literals that hub files use.
            value = _decode_infinity(json.load(f))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (OSError, RecursionError) as e:
        raise CheckpointError(f"{path} cannot be read: {e!r}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {_json_kind(value)}")
    return value


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            dict: "an object"}.get(type(value), type(value).__name__)


# Typed getters: every value read from config.json goes through one of these, so that a wrong type
# or an impossible value (hidden_size "abc", num_attention_heads 0, vocab_size -5, 80.5) is a
# CheckpointError naming the key instead of a TypeError / ZeroDivisionError deep in the model.
_REQUIRED = object()


def _need(cfg: dict[str, Any], key: str, family: str) -> Any:
    if key not in cfg:
        raise CheckpointError(f"config.json of a {family} model lacks the key '{key}'")
    return cfg[key]


_MAX_SIZE = 2**31 - 1  # no real size comes near it; beyond it tensor shapes overflow


def _int(cfg: dict[str, Any], key: str, family: str, default: Any = _REQUIRED, *, lo: int = 1) -> int:
    """cfg[key] as an integer in [lo, 2**31) (an integral float such as 64.0 is accepted). A missing
    or null key gives `default`; without one it is an error."""
    value = cfg.get(key)
    want = "a positive integer" if lo == 1 else f"an integer >= {lo}"
    if value is None:
        if default is _REQUIRED:
            _need(cfg, key, family)
            raise CheckpointError(f"config.json: '{key}' must be {want}, got null")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not value.is_integer()) or value < lo:
        raise CheckpointError(f"config.json: '{key}' must be {want}, got {value!r}")
    if value > _MAX_SIZE:
        raise CheckpointError(f"config.json: '{key}' = {value!r} is implausibly large (more than {_MAX_SIZE})")
    return int(value)


def _float(cfg: dict[str, Any], key: str, default: float, *, positive: bool = False) -> float:
    """cfg[key] as a finite float (> 0 if `positive`); missing or null gives `default`."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and not value > 0):
        what = "a finite number > 0" if positive else "a finite number"
        raise CheckpointError(f"config.json: '{key}' must be {what}, got {value!r}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json: '{key}' must be true or false, got {value!r}")
    return value


def _str(cfg: dict[str, Any], key: str, default: str, choices: tuple[str, ...] | None = None) -> str:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or (choices is not None and value not in choices):
        want = f"one of {list(choices)}" if choices is not None else "a string"
        raise CheckpointError(f"config.json: '{key}' must be {want}, got {value!r}")
    return value


def _dict(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json: '{key}' must be an object, got {value!r}")
    return value


def _floats(cfg: dict[str, Any], key: str, count: int, default: tuple[float, ...]) -> tuple[float, ...]:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, (list, tuple)) or len(value) != count \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise CheckpointError(f"config.json: '{key}' must be a list of {count} finite numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _dt_limit(cfg: dict[str, Any], key: str) -> tuple[float, float]:
    """(low, high) clamp of the Mamba dt: 0 <= low <= high, high may be infinite."""
    value = cfg.get(key)
    if value is None or (isinstance(value, (list, tuple)) and not value):  # null or [] (Falcon-H1): no clamp
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2 \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in value) \
            or not 0 <= value[0] <= value[1] or math.isinf(value[0]):
        raise CheckpointError(f"config.json: '{key}' must be [low, high] with 0 <= low <= high, got {value!r}")
    return (float(value[0]), float(value[1]))


def _time_step_min(cfg: dict[str, Any]) -> float:
    value = _float(cfg, "time_step_min", 0.001)
    if value < 0:
        raise CheckpointError(f"config.json: 'time_step_min' must be >= 0, got {value!r}")
    return value


# transformers' ACT2FN names that the layers implement (hybrid/layers.activation); "swish" is silu
_ACTIVATIONS = ("relu2", "silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def _act(cfg: dict[str, Any], key: str, default: str) -> str:
    """An activation name (cfg[key]) as the layers spell it; CheckpointError naming the key for one
    that is not implemented."""
    name = _str(cfg, key, default, _ACTIVATIONS)
    return "silu" if name == "swish" else name


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _token_id(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{key} must be a token id, got {value!r}")
    return value


def _rope(cfg: dict[str, Any], head_dim: int, default_partial: float | None) -> tuple[float, int]:
    """(theta, rotary dim). `default_partial` None: the family's RoPE rotates whole heads whatever
    partial_rotary_factor says (transformers' default RoPE of Granite, Falcon-H1 and Zamba2 does not
    read it); else (Bamba) rope_parameters' partial_rotary_factor, by default `default_partial`
    (transformers' BambaConfig overrides a top-level partial_rotary_factor with 0.5, so only the one
    inside rope_parameters counts)."""
    params = _dict(cfg, "rope_parameters")
    scaling = _dict(cfg, "rope_scaling")
    theta = _float(params, "rope_theta", _float(cfg, "rope_theta", 10000.0, positive=True), positive=True)
    if default_partial is None:
        partial = 1.0
    else:
        partial = _float(params, "partial_rotary_factor", default_partial, positive=True)
    if partial > 1.0:
        raise CheckpointError(f"config.json: 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    # (older configs spell rope_scaling's type as "type": a linear or dynamic scaling is not ignored)
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")) if scaling else None)
    if rope_type not in (None, "default"):
        raise CheckpointError(f"unsupported rope_type '{rope_type}' (only the default RoPE is implemented)")
    rotary = int(head_dim * partial)
    if rotary < 1:
        raise CheckpointError(f"config.json: partial_rotary_factor {partial!r} leaves no rotary dims of the "
                              f"{head_dim}-dim heads")
    return theta, rotary


def _check_divides(what: str, a: int, b: int, a_name: str, b_name: str) -> None:
    if a % b:
        raise CheckpointError(f"config.json: {a_name} ({a}) must be a multiple of {b_name} ({b}) ({what})")
