"""A config.json key left out means what transformers' config class defaults it to.

Hub configs leave keys out (older exports, hand-written configs); transformers then uses its config
class's default. For every family and every key of that class's defaults, parsing a config that
holds the key at its default value must give the same ModelConfig as parsing it without the key:
our fallback for a missing key is transformers' default. Checked on the class's default config
itself (every key at its default) and on the released configs (tests/data/released_configs.json).
Parsing only: no model is built, the whole module runs in well under a second.
"""
from __future__ import annotations

import copy
import json

import pytest

import released_shapes
from hybrid.config_parse import parse_config
from hybrid.errors import CheckpointError

_CLASSES = {
    "nemotron_h": "NemotronHConfig",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "bamba": "BambaConfig",
    "falcon_h1": "FalconH1Config",
    "zamba2": "Zamba2Config",
}

# keys that describe the model's structure and that no real config leaves out: without them we refuse
# (naming the key) rather than build transformers' default layer list
_STRUCTURAL = {
    "nemotron_h": {"layers_block_type", "hybrid_override_pattern"},
    "zamba2": {"layers_block_type"},
}
# keys transformers derives in __post_init__ (to_dict() writes them) that are not defaults of their own
_DERIVED = {"zamba2": {"attention_hidden_size", "attention_head_dim", "mamba_headdim", "kv_channels",
                       "num_query_groups", "hybrid_layer_ids"}}
# the size keys we require (a null or missing hidden size is refused, tests/test_bad_checkpoints.py)
_REQUIRED = {"vocab_size", "hidden_size", "num_attention_heads", "model_type"}


def _defaults(family: str, **kwargs) -> dict:
    import transformers

    cls = getattr(transformers, _CLASSES[family])
    d = cls(**kwargs).to_dict()
    return json.loads(json.dumps(d))  # tuples as lists, as config.json holds them


def _cases():
    for family in _CLASSES:
        yield pytest.param(family, None, id=f"{family}-defaults")
        # hidden / heads no longer the default head_dim, mamba_expand * hidden no longer mamba_d_ssm, ...
        yield pytest.param(family, _defaults(family, hidden_size=2048), id=f"{family}-hidden2048")
    for e in released_shapes.entries():
        yield pytest.param(e["config"]["model_type"], e["config"], id=e["name"])


@pytest.mark.parametrize("family, config", list(_cases()))
def test_missing_key_means_the_transformers_default(family, config):
    defaults = _defaults(family)
    base = copy.deepcopy(config) if config is not None else dict(defaults)
    base["model_type"] = family
    want = parse_config(base)
    skip = _STRUCTURAL.get(family, set()) | _DERIVED.get(family, set()) | _REQUIRED
    wrong = []
    for key, value in defaults.items():
        if key in skip or key not in base or base[key] != value:
            continue
        cut = {k: v for k, v in base.items() if k != key}
        try:
            got = parse_config(cut)
        except CheckpointError as e:
            wrong.append(f"{key}: refused without it ({e})")
            continue
        if got != want:
            diff = [f for f in want.__dataclass_fields__ if getattr(got, f) != getattr(want, f)]
            wrong.append(f"{key} (default {value!r}): changes {', '.join(diff)}")
    assert not wrong, f"{family}: a missing key does not mean transformers' default:\n  " + "\n  ".join(wrong)


def test_nemotron_h_prefill_clamps_dt_to_time_step_limit():
    """NemotronH's prefill clamps dt to config.time_step_limit (NVIDIA's implementation, transformers
    5.25), not from time_step_min; the legacy spelling mamba_dt_limit wins, as in NemotronHConfig."""
    import math

    import transformers

    base = _defaults("nemotron_h")
    base.update(model_type="nemotron_h", time_step_min=0.01, time_step_limit=[0.0, 0.5])
    assert parse_config(base).mamba.dt_limit == (0.0, 0.5)
    legacy = dict(base, mamba_dt_limit=[0.001, math.inf])
    assert parse_config(legacy).mamba.dt_limit == (0.001, math.inf)
    hf = transformers.NemotronHConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert tuple(hf.time_step_limit) == parse_config(legacy).mamba.dt_limit
    unset = {k: v for k, v in base.items() if k != "time_step_limit"}
    assert parse_config(unset).mamba.dt_limit == (0.0, math.inf)  # transformers' default: no clamp
