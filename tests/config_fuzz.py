"""Config fuzzing against transformers: random, tiny, released-style config variants of every family.

Each variant is a dict of config kwargs for the family's transformers config class (drawn from the
options transformers implements and real checkpoints use: GQA ratios, head dims that are not
hidden/heads, biases, Mamba groups / conv widths / chunk sizes / head dims / expansion, dt limits,
norm eps, tied or untied embeddings, layer patterns, MoE routing options, multipliers, RoPE or NoPE,
Zamba2's shared blocks ...). `run_case` builds it with transformers' own classes, re-draws the weights
(tests/tiny_checkpoints._redraw_weights), saves it with `save_pretrained`, optionally deletes from
config.json the keys whose value is transformers' default (a hub config that leaves them out) or
rewrites it in hub spellings, and compares the runtime's greedy tokens and top-5 logprobs with
transformers' greedy `generate` of each prompt alone (eager attention, fp32), and its prompt logprobs
with transformers' no-cache forward over the prompt. All prompts go in one `generate` call, with
small token budgets (chunked prefill) and page sizes drawn too.

A divergence ("diverged") is: a token that differs where transformers' top-2 gap is not a near-tie,
or a logprob off by more than ATOL + RTOL * |logprob| that an fp64 transformers run does not explain
as fp32 noise ("noisy" otherwise); "crash": an exception; "refused": a CheckpointError (acceptable
only when it names an option that is truly unsupported); "hf_rejects": transformers itself refuses
or fails on the variant (not ours to match).

By hand (a few hundred variants, ~1-3 s each on one core):

    .venv/bin/python tests/config_fuzz.py --family all --n 40 --seed 0 --out /tmp/fuzz.jsonl

tests/test_config_fuzz.py runs a curated, fixed list of variants (the ones that found bugs and a
few representative ones) in the CI suite.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_checkpoints  # noqa: E402
from tiny_checkpoints import BOS_ID, EOS_ID, PAD_ID, _redraw_weights, scale_zamba2_queries  # noqa: E402

ATOL = 1e-4
RTOL = 1e-5
NEAR_TIE = 1e-3  # a token mismatch where HF's top-2 gap is below this is rounding noise, not a bug
# logprobs off by more than ATOL but no further from an fp64 transformers run than NOISE_FACTOR times
# transformers' own fp32 run is: "noisy" (fp32 rounding amplified by the variant), not a divergence
NOISE_FACTOR = 4.0
MAX_NEW = 12
TOP_K = 5
FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2")

_CLASSES = {
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM"),
}


# ----------------------------------------------------------------------------------------------
# drawing variants
# ----------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _attention(r: random.Random, hidden: int, *, free_head_dim: bool = True) -> dict:
    heads = r.choice([h for h in (1, 2, 3, 4, 5, 6, 8, 10) if hidden % h == 0 and hidden // h >= 4])
    kv = r.choice(_divisors(heads))
    out = {"num_attention_heads": heads, "num_key_value_heads": kv}
    if free_head_dim and r.random() < 0.5:
        out["head_dim"] = r.choice([8, 12, 16, 24, 32])
    return out


HIDDEN_SIZES = (32, 40, 48, 60, 64)


def _common(r: random.Random) -> dict:
    return {
        "vocab_size": r.choice([100, 128, 131, 160, 200]),
        "max_position_embeddings": 512,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    }


def _mamba_heads(r: random.Random, inner: int) -> tuple[int, int]:
    """(num heads, head dim) with heads * dim == inner."""
    nh = r.choice([d for d in _divisors(inner) if 2 <= d <= 16 and inner // d >= 4])
    return nh, inner // nh


def _dt_limit(r: random.Random):
    return r.choice([(0.0, float("inf")), (0.0, 0.15), (0.01, 0.1), (0.02, float("inf"))])


def draw_nemotron_h(r: random.Random) -> dict:
    hidden = r.choice(HIDDEN_SIZES)
    letters = "M*-E"
    n = r.randint(2, 5)
    pattern = "".join(r.choice(letters) for _ in range(n))
    if "M" not in pattern:
        pattern = "M" + pattern[1:]
    if "*" not in pattern:  # (transformers' generate needs an attention layer in the cache)
        i = r.choice([i for i, c in enumerate(pattern) if c != "M"] or [len(pattern)])
        pattern = pattern[:i] + "*" + pattern[i + 1:]
    nh = r.choice([2, 4, 6, 8])
    cfg = dict(_common(r), hidden_size=hidden, hybrid_override_pattern=pattern, **_attention(r, hidden))
    cfg.setdefault("head_dim", hidden // cfg["num_attention_heads"])
    cfg.update(
        intermediate_size=r.choice([32, 48, 96]),
        mamba_num_heads=nh, mamba_head_dim=r.choice([4, 8, 16]),
        ssm_state_size=r.choice([4, 5, 8, 16]), n_groups=r.choice(_divisors(nh)),
        conv_kernel=r.choice([1, 2, 3, 4, 4]), chunk_size=r.choice([4, 8, 16, 32]),
        use_conv_bias=r.random() < 0.7, use_bias=r.random() < 0.3, mlp_bias=r.random() < 0.25,
        mlp_hidden_act=r.choice(["relu2", "relu2", "silu", "gelu", "relu", "gelu_new"]),
        mamba_hidden_act=r.choice(["silu", "silu", "silu", "gelu"]),
        attention_bias=r.random() < 0.2, mamba_proj_bias=r.random() < 0.2,
        layer_norm_epsilon=r.choice([1e-5, 1e-6, 1e-3]),
        time_step_min=r.choice([1e-3, 1e-2, 0.05]),
        time_step_limit=r.choice([(0.0, float("inf")), (0.0, 0.1)]),
        tie_word_embeddings=r.random() < 0.3,
        residual_in_fp32=r.random() < 0.3,
    )
    if "E" in pattern:
        e = r.choice([4, 6, 8])
        n_group = r.choice(_divisors(e))
        if e // n_group < 2:  # the group score sums each group's top-2
            n_group = 1
        cfg.update(
            n_routed_experts=e, num_experts_per_tok=r.randint(1, min(4, e)),
            n_group=n_group, topk_group=r.randint(1, n_group),
            norm_topk_prob=r.random() < 0.6, routed_scaling_factor=r.choice([1.0, 2.5, 0.7]),
            moe_intermediate_size=r.choice([16, 32]), moe_shared_expert_intermediate_size=r.choice([16, 48]),
        )
        # topk experts must fit in the chosen groups
        per = e // n_group
        if cfg["num_experts_per_tok"] > cfg["topk_group"] * per:
            cfg["num_experts_per_tok"] = cfg["topk_group"] * per
    return cfg


def _bamba_like_mamba(r: random.Random, hidden: int, *, d_ssm: bool = False) -> dict:
    expand = r.choice([1, 2, 2, 3])
    inner = expand * hidden
    out = {"mamba_expand": expand}
    if d_ssm and r.random() < 0.4:
        inner = r.choice([64, 96, 128])
        out["mamba_d_ssm"] = inner
    elif d_ssm:
        out["mamba_d_ssm"] = None
    nh, hd = _mamba_heads(r, inner)
    out.update(mamba_n_heads=nh, mamba_d_head=hd if r.random() < 0.5 else "auto",
               mamba_n_groups=r.choice(_divisors(nh)), mamba_d_state=r.choice([4, 6, 8, 16]),
               mamba_d_conv=r.choice([2, 3, 4, 4]), mamba_chunk_size=r.choice([4, 8, 16, 32]),
               mamba_conv_bias=r.random() < 0.7, mamba_proj_bias=r.random() < 0.3,
               time_step_limit=_dt_limit(r))
    return out


def _layer_types(r: random.Random, n: int) -> list[str]:
    types = [r.choice(["mamba", "mamba", "attention"]) for _ in range(n)]
    if "mamba" not in types:
        types[0] = "mamba"
    if "attention" not in types:  # (transformers' generate needs an attention layer in the cache)
        types[r.randrange(1, n)] = "attention"
    return types


def draw_granite(r: random.Random) -> dict:
    hidden = r.choice(HIDDEN_SIZES)
    n = r.randint(2, 5)
    cfg = dict(_common(r), hidden_size=hidden, num_hidden_layers=n, layer_types=_layer_types(r, n),
               **_attention(r, hidden), **_bamba_like_mamba(r, hidden))
    moe = r.random() < 0.6
    cfg.update(
        intermediate_size=r.choice([16, 32]), shared_intermediate_size=r.choice([32, 64, 96]),
        num_local_experts=r.choice([2, 4, 6]) if moe else 0,
        rms_norm_eps=r.choice([1e-6, 1e-5, 1e-3]),
        embedding_multiplier=r.choice([1.0, 12.0, 3.0]), residual_multiplier=r.choice([1.0, 0.22, 0.5]),
        attention_multiplier=r.choice([1.0, 1 / 16, 0.125, 0.3]), logits_scaling=r.choice([1.0, 8.0, 2.5]),
        position_embedding_type=r.choice([None, "nope", "rope"]),
        tie_word_embeddings=r.random() < 0.6, attention_bias=r.random() < 0.3,
        hidden_act=r.choice(["silu", "silu", "gelu", "gelu_pytorch_tanh"]),
    )
    if moe and r.random() < 0.15:
        cfg["shared_intermediate_size"] = 0
    cfg["num_experts_per_tok"] = r.randint(1, cfg["num_local_experts"]) if moe else 0
    if cfg["position_embedding_type"] == "rope":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": r.choice([10000.0, 500.0])}
        if r.random() < 0.3:
            cfg["rope_parameters"]["partial_rotary_factor"] = 0.5
    return cfg


def draw_bamba(r: random.Random) -> dict:
    hidden = r.choice(HIDDEN_SIZES)
    n = r.randint(2, 5)
    attn = sorted(r.sample(range(n), r.randint(1, n - 1)))  # (generate needs an attention layer)
    cfg = dict(_common(r), hidden_size=hidden, num_hidden_layers=n, attn_layer_indices=attn,
               **_attention(r, hidden), **_bamba_like_mamba(r, hidden))
    cfg.update(intermediate_size=r.choice([32, 96]), rms_norm_eps=r.choice([1e-5, 1e-6, 1e-3]),
               tie_word_embeddings=r.random() < 0.3, attention_bias=r.random() < 0.3, mlp_bias=r.random() < 0.3,
               hidden_act=r.choice(["silu", "silu", "gelu", "relu"]))
    rope = {"rope_type": "default", "rope_theta": r.choice([10000.0, 500.0])}
    if r.random() < 0.4:
        rope["partial_rotary_factor"] = r.choice([0.5, 1.0, 0.25])
    cfg["rope_parameters"] = rope
    return cfg


def draw_falcon_h1(r: random.Random) -> dict:
    hidden = r.choice(HIDDEN_SIZES)
    n = r.randint(2, 4)
    cfg = dict(_common(r), hidden_size=hidden, num_hidden_layers=n, **_attention(r, hidden),
               **_bamba_like_mamba(r, hidden, d_ssm=True))
    rms = r.random() < 0.5

    def m(*choices):
        return r.choice((1.0,) + choices)

    proj_bias = cfg["mamba_proj_bias"]
    cfg.update(
        intermediate_size=r.choice([32, 96]), rms_norm_eps=r.choice([1e-5, 1e-6]),
        mamba_rms_norm=rms, mamba_norm_before_gate=r.random() < 0.5,
        projectors_bias=proj_bias if r.random() < 0.8 else not proj_bias,
        tie_word_embeddings=r.random() < 0.3, attention_bias=r.random() < 0.3, mlp_bias=r.random() < 0.25,
        hidden_act=r.choice(["silu", "silu", "gelu", "gelu_new"]),
        rope_parameters={"rope_type": "default", "rope_theta": r.choice([10000.0, 1e11, 500.0])},
        embedding_multiplier=m(1.7, 5.0), lm_head_multiplier=m(0.8, 0.03), key_multiplier=m(0.7, 1.4),
        attention_in_multiplier=m(1.3), attention_out_multiplier=m(0.9), ssm_in_multiplier=m(1.2),
        ssm_out_multiplier=m(0.85),
        ssm_multipliers=[m(0.9), m(1.1), m(0.8), m(1.25), m(0.7)], mlp_multipliers=[m(1.2), m(0.75)],
    )
    return cfg


def draw_zamba2(r: random.Random) -> dict:
    hidden = r.choice(HIDDEN_SIZES)
    n = r.randint(2, 6)
    layers = [r.choice(["mamba", "hybrid"]) for _ in range(n)]
    if "hybrid" not in layers:
        layers[r.randrange(n)] = "hybrid"
    heads = r.choice([h for h in (2, 4, 8) if (2 * hidden) % h == 0])
    adapters = r.random() < 0.5
    kv = heads if adapters else r.choice(_divisors(heads))
    expand = r.choice([1, 2])
    inner = expand * hidden
    nh = r.choice([d for d in _divisors(inner) if 2 <= d <= 16 and inner // d >= 4])
    cfg = dict(_common(r), hidden_size=hidden, num_hidden_layers=n, layers_block_type=layers,
               num_attention_heads=heads, num_key_value_heads=kv,
               mamba_d_state=r.choice([4, 8, 16]), mamba_d_conv=r.choice([2, 3, 4]), mamba_expand=expand,
               mamba_ngroups=r.choice(_divisors(nh)), n_mamba_heads=nh, chunk_size=r.choice([4, 8, 16, 32]),
               intermediate_size=r.choice([32, 96, None]),
               hidden_act=r.choice(["gelu", "gelu", "silu", "gelu_pytorch_tanh"]),
               num_mem_blocks=r.choice([1, 2, 3]), use_shared_attention_adapter=adapters,
               adapter_rank=r.choice([4, 8]), use_mem_rope=r.random() < 0.5,
               rope_parameters={"rope_type": "default", "rope_theta": r.choice([10000.0, 500.0])},
               rms_norm_eps=r.choice([1e-5, 1e-6]), time_step_min=r.choice([1e-3, 1e-2]),
               tie_word_embeddings=r.random() < 0.7, add_bias_linear=r.random() < 0.3,
               use_conv_bias=r.random() < 0.8, use_long_context=r.random() < 0.1)
    return cfg


DRAW = {"nemotron_h": draw_nemotron_h, "granitemoehybrid": draw_granite, "bamba": draw_bamba,
        "falcon_h1": draw_falcon_h1, "zamba2": draw_zamba2}


def draw(family: str, seed: int) -> dict:
    r = random.Random(f"{family}-{seed}")
    cfg = DRAW[family](r)
    # about one variant in four: config.json leaves out the keys whose value is transformers' default
    cfg["_drop_defaults"] = r.random() < 0.25
    cfg["_budget"] = r.choice([None, None, 16, 5])
    cfg["_page_size"] = r.choice([16, 16, 5])
    # the config.json spellings of hub files (pattern string, legacy layer / key names)
    cfg["_hub"] = r.random() < 0.3
    # a tied checkpoint that also stores an lm_head.weight of its own (transformers then does not tie)
    cfg["_own_lm_head"] = family != "nemotron_h" and cfg.get("tie_word_embeddings", False) and r.random() < 0.25
    return cfg


# ----------------------------------------------------------------------------------------------
# building
# ----------------------------------------------------------------------------------------------

def _redraw(family: str, model, cfg: dict, seed: int) -> None:
    if family == "granitemoehybrid":
        emb, res = cfg.get("embedding_multiplier", 1.0), cfg.get("residual_multiplier", 1.0)
        _redraw_weights(model, seed, embed_std=0.36 / emb, branch_out_scale=13.0 / res,
                        final_norm_scale=7.5 * cfg.get("logits_scaling", 1.0) * emb / 12.0)
        model.tie_weights()
    elif family == "zamba2":
        _redraw_weights(model, seed, branch_out_scale=2.5, final_norm_scale=0.5)
        scale_zamba2_queries(model, 0.4)
        model.tie_weights()
    elif family == "falcon_h1":
        _redraw_weights(model, seed, final_norm_scale=1.0 / cfg.get("lm_head_multiplier", 1.0) ** 0.5)
        model.tie_weights()
    else:
        _redraw_weights(model, seed, lm_head_std=6.0 / math.sqrt(cfg["hidden_size"]) if family == "nemotron_h" else None)
        model.tie_weights()


def build(family: str, cfg: dict, path, seed: int = 0) -> Path:
    """transformers model of `cfg` (kwargs of the family's config class), weights re-drawn, saved."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[family])
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_")}
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _redraw(family, model, cfg, seed)
    path = Path(path)
    model.save_pretrained(str(path), safe_serialization=True)
    if cfg.get("_drop_defaults"):
        drop_default_keys(family, path)
    if cfg.get("_hub"):
        tiny_checkpoints.rewrite_config(path, HUBIFY[family])
    if cfg.get("_own_lm_head"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path / "model.safetensors"))
        embed = tensors["model.embed_tokens.weight"]
        g = torch.Generator().manual_seed(seed + 1)
        tensors["lm_head.weight"] = (embed + 0.5 * embed.std() * torch.randn(embed.shape, generator=g)).contiguous()
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _hub_nemotron(cfg: dict) -> None:
    if "layers_block_type" in cfg:  # (not when left out as transformers' default)
        tiny_checkpoints.hubify_nemotron_h(cfg)
    # NemotronHConfig's legacy mamba_* spellings (which it reads in preference to the new keys)
    for new, old in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"), ("chunk_size", "mamba_chunk_size"),
                     ("use_conv_bias", "mamba_conv_bias"), ("time_step_limit", "mamba_dt_limit")):
        if new in cfg:
            cfg[old] = cfg.pop(new)


def _hub_if(key, fn):
    def rewrite(cfg: dict) -> None:
        if key in cfg:
            fn(cfg)
    return rewrite


HUBIFY = {"nemotron_h": _hub_nemotron, "granitemoehybrid": _hub_if("layer_types", tiny_checkpoints.hubify_granite),
          "bamba": lambda cfg: None, "falcon_h1": lambda cfg: None,
          "zamba2": _hub_if("layers_block_type", tiny_checkpoints.hubify_zamba2)}


_KEEP = {"model_type", "architectures", "vocab_size", "hidden_size", "transformers_version", "dtype"}


def drop_default_keys(family: str, path: Path) -> list[str]:
    """Delete from config.json every key whose value equals the config class's default (what a
    hub config that leaves keys out means); returns them."""
    import transformers

    cfg_cls = getattr(transformers, _CLASSES[family][0])
    defaults = cfg_cls().to_dict()
    p = path / "config.json"
    cfg = json.loads(p.read_text(), object_hook=tiny_checkpoints._decode_float_tags)
    dropped = []
    for k in list(cfg):
        if k in _KEEP or k not in defaults:
            continue
        d, v = defaults[k], cfg[k]
        if isinstance(d, tuple):
            d = list(d)
        if v == d and type(v) is type(d):
            dropped.append(k)
            del cfg[k]
    p.write_text(json.dumps(cfg, indent=2))
    return dropped


# ----------------------------------------------------------------------------------------------
# comparing
# ----------------------------------------------------------------------------------------------

def prompts_for(vocab: int, chunk: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = sorted({1, 3, max(2, chunk - 1), chunk + 1, 2 * chunk + 3})[:4]
    lengths = [min(n, 40) for n in lengths]
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_runs(path, prompts, max_new: int):
    import hf_oracle
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float32).eval()
    runs = [hf_oracle._generate_one(model, p, max_new) for p in prompts]
    for run in runs:  # every prompt position (prefill path): one no-cache forward over the prompt
        run.prompt_lp = torch.log_softmax(model(torch.tensor([run.prompt]), use_cache=False).logits[0].float(), -1)
    return runs


@torch.no_grad()
def fp64_noise(path, runs, outs) -> tuple[float, float]:
    """(transformers fp32 vs fp64, runtime vs fp64): the largest top-k logprob differences along the
    steps where all three chose the same tokens. Tells fp32 rounding noise (amplified by a variant's
    sharp softmaxes or large multipliers) from a real divergence."""
    import hf_oracle
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    hf_err = ours_err = 0.0
    for run, out in zip(runs, outs):
        ref = hf_oracle._generate_one(model, run.prompt, len(run.tokens))
        ref_plp = torch.log_softmax(model(torch.tensor([run.prompt]), use_cache=False).logits[0].float(), -1)
        hf_err = max(hf_err, float((run.prompt_lp - ref_plp).abs().max()))
        for i, entry in enumerate(out.prompt_logprobs[1:] if out.prompt_logprobs else []):
            for t, v in entry.items():
                ours_err = max(ours_err, abs(v - float(ref_plp[i, t])))
        comp = out.outputs[0]
        for step, (a, b, c) in enumerate(zip(run.tokens, ref.tokens, comp.token_ids)):
            top = torch.topk(ref.logprobs[step], TOP_K).indices
            hf_err = max(hf_err, float((run.logprobs[step][top] - ref.logprobs[step][top]).abs().max()))
            for t, v in comp.logprobs[step].items():
                ours_err = max(ours_err, abs(v - float(ref.logprobs[step][t])))
            if not a == b == c:
                break
    return hf_err, ours_err


def _logprob_mismatch(entry: dict, ref, stats: dict, what: str) -> str | None:
    """The first of `entry`'s logprobs {token: value} off the reference row `ref` by more than the
    tolerance, described (None: all within it); stats["worst"] takes every error."""
    bad = None
    for t, v in entry.items():
        r = float(ref[t])
        err = abs(v - r)
        stats["worst"] = max(stats["worst"], err)
        if err > ATOL + RTOL * abs(r) and bad is None:
            bad = f"{what}: logprob of {t} {v:.6f} vs HF {r:.6f} (|diff| {err:.2e})"
    return bad


def compare(runs, outs) -> tuple[list[str], dict]:
    """Problems (one at most per prompt: later steps condition on what came before) and stats."""
    problems = []
    stats = {"steps": 0, "near_ties": 0, "worst": 0.0}
    for run, out in zip(runs, outs):
        comp = out.outputs[0]
        got = list(comp.token_ids)
        where = f"prompt len {len(run.prompt)}"
        if len(got) != len(run.tokens):
            problems.append(f"{where}: {len(got)} tokens, HF {len(run.tokens)}")
        for i, entry in enumerate(out.prompt_logprobs[1:] if out.prompt_logprobs else []):
            bad = _logprob_mismatch(entry, run.prompt_lp[i], stats, f"{where} prompt position {i + 1}")
            if bad is not None:
                problems.append(bad)
                break
        for step in range(min(len(run.tokens), len(got))):
            bad = _logprob_mismatch(comp.logprobs[step] if comp.logprobs else {}, run.logprobs[step], stats,
                                    f"{where} step {step}")
            if bad is not None:
                problems.append(bad)
                break
            if got[step] != run.tokens[step]:
                gap = run.top2_gap(step)
                if gap < NEAR_TIE:
                    stats["near_ties"] += 1
                else:
                    problems.append(f"{where} step {step}: token {got[step]} vs HF {run.tokens[step]} "
                                    f"(HF gap {gap:.4f})")
                break
            stats["steps"] += 1
    return problems, stats


def _chunk_of(family: str, cfg: dict) -> int:
    return int(cfg.get("chunk_size", cfg.get("mamba_chunk_size", 8)) or 8)


def run_case(family: str, cfg: dict, seed: int = 0, workdir=None, max_new: int = MAX_NEW) -> dict:
    """Build, save, load both ways, compare. Returns {"status": ..., ...}; statuses: ok, diverged,
    crash, refused, hf_rejects, ill_conditioned."""
    from hybrid import LLM, SamplingParams
    from hybrid.errors import CheckpointError

    t0 = time.perf_counter()
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-")) if own else Path(workdir)
    path = workdir / f"{family}-{seed}"
    if path.exists():
        shutil.rmtree(path)
    res = {"family": family, "seed": seed, "config": cfg}
    try:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                build(family, cfg, path, seed)
        except Exception as e:  # transformers refuses the combination: not a variant it supports
            res.update(status="hf_rejects", error=f"{type(e).__name__}: {e}"[:400])
            return res
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = prompts_for(vocab, _chunk_of(family, cfg), seed)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                runs = hf_runs(path, prompts, max_new)
        except Exception as e:
            res.update(status="hf_rejects", error=f"HF load/generate: {type(e).__name__}: {e}"[:400])
            return res
        kwargs = {"device": "cpu", "dtype": torch.float32, "page_size": cfg.get("_page_size", 16)}
        if cfg.get("_budget"):
            kwargs["max_num_batched_tokens"] = cfg["_budget"]
        try:
            llm = LLM(str(path), **kwargs)
        except CheckpointError as e:
            res.update(status="refused", error=str(e)[:600])
            return res
        except Exception as e:
            res.update(status="crash", error=f"load: {type(e).__name__}: {e}"[:600], tb=traceback.format_exc()[-2000:])
            return res
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=TOP_K,
                                    prompt_logprobs=2)
            outs = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:
            res.update(status="crash", error=f"generate: {type(e).__name__}: {e}"[:600],
                       tb=traceback.format_exc()[-2000:])
            return res
        finally:
            del llm
        problems, stats = compare(runs, outs)
        res.update(stats)
        if problems and not any(": token" in p for p in problems):
            hf_err, ours_err = fp64_noise(path, runs, outs)
            res.update(hf32_vs_fp64=hf_err, ours_vs_fp64=ours_err)
            if ours_err <= max(ATOL, NOISE_FACTOR * hf_err):
                # off by more than ATOL, but no further from the fp64 reference than transformers' fp32
                res.update(status="noisy", problems=problems[:8])
                return res
        if problems:
            res.update(status="diverged", problems=problems[:8])
        elif stats["steps"] < max_new:
            res.update(status="ill_conditioned")
        else:
            res.update(status="ok")
        return res
    finally:
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _jsonable(obj):
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="all")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="first variant seed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", type=int, nargs="*", help="variant seeds to run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("hybrid").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    families = FAMILIES if args.family == "all" else tuple(args.family.split(","))
    seeds = args.only if args.only else range(args.seed, args.seed + args.n)
    counts: dict[str, dict[str, int]] = {}
    out = open(args.out, "a") if args.out else None
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        for fam in families:
            for s in seeds:
                cfg = draw(fam, s)
                res = run_case(fam, cfg, seed=s, workdir=tmp)
                counts.setdefault(fam, {}).setdefault(res["status"], 0)
                counts[fam][res["status"]] += 1
                line = f"{fam:16s} seed {s:4d} {res['status']:15s} {res.get('seconds', 0):5.1f}s"
                if res["status"] not in ("ok",):
                    line += "  " + (res.get("error") or "; ".join(res.get("problems", [])) or "")[:300]
                print(line, flush=True)
                if out:
                    out.write(json.dumps(_jsonable(res)) + "\n")
                    out.flush()
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# neutral values: applying one to a diverging variant and seeing the divergence go names its cause
NEUTRAL = {
    "nemotron_h": {"tie_word_embeddings": False, "mlp_hidden_act": "relu2", "use_bias": False, "mlp_bias": False,
                   "_drop_defaults": False, "_budget": None, "residual_in_fp32": False, "use_conv_bias": True,
                   "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                   "head_dim": None, "layer_norm_epsilon": 1e-5, "time_step_min": 1e-3, "conv_kernel": 4},
    "granitemoehybrid": {"tie_word_embeddings": True, "hidden_act": "silu", "_drop_defaults": False, "_budget": None,
                         "position_embedding_type": "nope", "attention_bias": False, "mamba_proj_bias": False,
                         "mamba_conv_bias": True, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                         "attention_multiplier": 0.25, "logits_scaling": 1.0, "time_step_limit": (0.0, float("inf")),
                         "head_dim": None, "mamba_d_head": "auto", "mamba_expand": 2, "rms_norm_eps": 1e-6},
    "bamba": {"tie_word_embeddings": False, "hidden_act": "silu", "_drop_defaults": False, "_budget": None,
              "attention_bias": False, "mlp_bias": False, "mamba_proj_bias": False, "mamba_conv_bias": True,
              "time_step_limit": (0.0, float("inf")), "head_dim": None, "mamba_d_head": "auto",
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "falcon_h1": {"tie_word_embeddings": False, "hidden_act": "silu", "_drop_defaults": False, "_budget": None,
                  "attention_bias": False, "mlp_bias": False, "mamba_proj_bias": False, "projectors_bias": False,
                  "mamba_conv_bias": True, "time_step_limit": (0.0, float("inf")), "head_dim": None,
                  "mamba_d_head": "auto", "mamba_d_ssm": None, "mamba_rms_norm": False,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                  "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0,
                  "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
                  "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]},
    "zamba2": {"tie_word_embeddings": True, "hidden_act": "gelu", "_drop_defaults": False, "_budget": None,
               "add_bias_linear": False, "use_mem_rope": False, "num_mem_blocks": 1, "use_conv_bias": True,
               "use_long_context": False, "use_shared_attention_adapter": False},
}


for _n in NEUTRAL.values():
    _n.update({"_hub": False, "_own_lm_head": False, "_page_size": 16})
NEUTRAL["nemotron_h"].update({"mamba_hidden_act": "silu", "attention_bias": False, "mamba_proj_bias": False})


def culprits(family: str, cfg: dict, seed: int) -> list[str]:
    """The NEUTRAL keys whose neutral value alone makes the variant pass."""
    out = []
    for k, v in NEUTRAL[family].items():
        if k in cfg and cfg[k] == v or (k not in cfg and v is None):
            continue
        c = dict(cfg)
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
        res = run_case(family, c, seed=seed)
        if res["status"] in ("ok", "noisy", "ill_conditioned"):
            out.append(k)
    return out
