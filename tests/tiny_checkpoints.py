"""Tiny random hybrid Mamba2/attention checkpoints, written in the real on-disk format.

Every checkpoint is built with transformers' own model classes and written with
``save_pretrained`` (safetensors, fp32), so key names, expert stacking/unstacking,
config keys (``Infinity`` encodings, legacy layer-type names ...) are exactly what a
Hugging Face checkpoint looks like.

Weights are deterministic (``torch.manual_seed`` + a seeded generator) and are
re-drawn after transformers' init so that

* no tensor keeps a "neutral" default (norm weights of 1, zero biases, zero
  ``e_score_correction_bias``, arange A_log ...): a runtime that forgets to load
  one of them, or loads it into the wrong place, changes the logits;
* activations keep unit scale through the layers (std ~ 1/sqrt(fan_in)) so every
  layer matters, and the logits are spread out (top-2 gaps far above fp32
  rounding noise), which makes greedy token-for-token comparison well-posed;
* MoE router logits are O(1), so expert choice is not decided by rounding noise.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

# Shared small dimensions: hidden 64, mamba 8 heads x 16, state 16, conv 4, chunk 8.
HIDDEN = 64
MAMBA_HEADS = 8
MAMBA_HEAD_DIM = 16
SSM_STATE = 16
CONV_K = 4
CHUNK = 8
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
MAX_POS = 512

# Token ids shared by all checkpoints.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_NORMAL_ID = 4


# ----------------------------------------------------------------------------------------
# weight re-drawing
# ----------------------------------------------------------------------------------------


def _inv_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


@torch.no_grad()
def _redraw_weights(model: torch.nn.Module, seed: int, *, lm_head_std: float | None = None,
                    embed_std: float = 1.0, dt_floor_heads: bool = False,
                    branch_out_scale: float = 1.0, final_norm_scale: float = 1.0,
                    dt_range: tuple[float, float] = (1e-3, 0.2),
                    zero_logit_ids: tuple[int, ...] = ()) -> None:
    """Overwrite every parameter / persistent buffer with a well-conditioned random draw, on the
    model's own device (a CUDA generator draws a released-width model's weights in milliseconds;
    on CPU the draws are those of the CPU generator, as they always were)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=device)

    def rand(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float32, device=device)

    tensors = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        tensors.setdefault(name, buf)

    for name in sorted(tensors):
        t = tensors[name]
        leaf = name.rsplit(".", 1)[-1]
        if not t.is_floating_point():
            continue
        if leaf == "inv_freq" or "rotary" in name:
            continue  # RoPE tables: derived from config, not checkpoint data
        if leaf == "A_log":
            t.copy_(torch.log(1.0 + 15.0 * rand(*t.shape)))  # A in [-16, -1]
        elif leaf == "D":
            t.copy_(0.5 + rand(*t.shape))
        elif leaf == "dt_bias":
            # dt log-uniform in dt_range (real init: [1e-3, 1e-1])
            lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
            dt = torch.exp(rand(*t.shape) * (hi - lo) + lo)
            t.copy_(_inv_softplus(dt))
            if dt_floor_heads:
                # a couple of heads with softplus(dt) far below time_step_min: the prefill
                # clamps of the families that clamp from it (Zamba2), and dt near zero elsewhere
                t[0] = -9.0
                t[t.shape[0] // 2] = -8.0
        elif leaf == "e_score_correction_bias":
            t.copy_(0.3 * randn(*t.shape))
        elif t.dim() == 1 and leaf == "weight":  # every RMSNorm (incl. gated norm)
            t.copy_(0.6 + 0.8 * rand(*t.shape))
            if "layers." not in name:  # final norm: sets the logit scale
                t.mul_(final_norm_scale)
        elif t.dim() == 1 and leaf == "bias":
            t.copy_(0.1 * randn(*t.shape))
        elif "embed" in name:
            t.copy_(embed_std * randn(*t.shape))
        elif name.startswith("lm_head"):
            std = lm_head_std if lm_head_std is not None else 4.0 / math.sqrt(t.shape[-1])
            t.copy_(std * randn(*t.shape))
        elif leaf == "weight" and name.endswith("conv1d.weight"):
            t.copy_(randn(*t.shape) / math.sqrt(t.shape[-1]))
        elif t.dim() >= 2:
            # Linear / stacked expert weights: [.., out, in]; router weights too.
            t.copy_(randn(*t.shape) / math.sqrt(t.shape[-1]))
            if leaf in _BRANCH_OUT or leaf_module(name) in _BRANCH_OUT:
                t.mul_(branch_out_scale)
        else:
            raise AssertionError(f"unhandled tensor {name} {tuple(t.shape)}")

    for tid in zero_logit_ids:
        head = model.get_output_embeddings().weight
        head[tid].zero_()


# projections that write into the residual stream
_BRANCH_OUT = {"out_proj", "o_proj", "down_proj", "output_linear"}


def leaf_module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _finish(model, path: Path, *, max_shard_size=None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **kwargs)
    return path


# ----------------------------------------------------------------------------------------
# families
# ----------------------------------------------------------------------------------------


def build_nemotron_h(path, *, pattern: str = "M-M*EM", vocab_size: int = 160, seed: int = 1,
                     max_shard_size=None, zero_logit_ids: tuple[int, ...] = (),
                     dt_floor_heads: bool = True, dt_range=(1e-3, 0.2), moe_latent_size: int | None = None,
                     n_group: int = 2, mlp_bias: bool = False) -> Path:
    """NemotronH with Mamba (M), attention (*), relu^2 MLP (-) and MoE (E) layers; `moe_latent_size`:
    LatentMoE (Nemotron 3 Super), the routed experts between projections to and from that width."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        hybrid_override_pattern=pattern,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        intermediate_size=96,
        mamba_num_heads=MAMBA_HEADS,
        mamba_head_dim=MAMBA_HEAD_DIM,
        ssm_state_size=SSM_STATE,
        n_groups=2,
        conv_kernel=CONV_K,
        expand=2,
        chunk_size=CHUNK,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=n_group,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=moe_latent_size,
        mlp_bias=mlp_bias,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        layer_norm_epsilon=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).to(torch.float32).eval()
    _redraw_weights(model, seed, dt_floor_heads=dt_floor_heads, dt_range=dt_range,
                    zero_logit_ids=zero_logit_ids,
                    lm_head_std=6.0 / math.sqrt(HIDDEN))
    return _finish(model, path, max_shard_size=max_shard_size)


def build_granite_hybrid(path, *, moe: bool, vocab_size: int = 192, seed: int = 2,
                         layer_types=("mamba", "attention", "mamba", "mamba")) -> Path:
    """GraniteMoeHybrid (Granite 4.0-H): NoPE, multipliers, tied embeddings; dense or MoE."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=32,  # routed expert size
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=1.0 / 16,
        logits_scaling=8.0,
        position_embedding_type="nope",
        num_local_experts=4 if moe else 0,
        num_experts_per_tok=2 if moe else 0,
        shared_intermediate_size=96,
        mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM,
        mamba_n_groups=1,
        mamba_d_state=SSM_STATE,
        mamba_d_conv=CONV_K,
        mamba_expand=2,
        mamba_chunk_size=CHUNK,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(cfg).to(torch.float32).eval()
    # h0 = 12 * emb: the residual branches (x0.22) are scaled up so that they are not drowned
    # by the embedding (else the model just repeats its input token); tied logits =
    # emb @ norm(h) / 8 are spread out by a larger final-norm weight.
    _redraw_weights(model, seed, embed_std=0.03, branch_out_scale=60.0, final_norm_scale=60.0)
    model.tie_weights()
    return _finish(model, path)


def build_bamba(path, *, vocab_size: int = 224, seed: int = 3, num_layers: int = 5,
                attn_layer_indices=(2,), time_step_limit=(0.0, float("inf"))) -> Path:
    """Bamba: Mamba2 + attention (partial RoPE, factor 0.5) + SwiGLU MLP in every layer."""
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        attn_layer_indices=list(attn_layer_indices),
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        max_position_embeddings=MAX_POS,
        mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM,
        mamba_n_groups=2,
        mamba_d_state=SSM_STATE,
        mamba_d_conv=CONV_K,
        mamba_expand=2,
        mamba_chunk_size=CHUNK,
        time_step_limit=tuple(time_step_limit),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = BambaForCausalLM(cfg).to(torch.float32).eval()
    _redraw_weights(model, seed)
    return _finish(model, path)


def build_falcon_h1(path, *, vocab_size: int = 208, seed: int = 6, num_layers: int = 3, rms_norm: bool = False,
                    norm_before_gate: bool = True, time_step_limit=(0.0, float("inf"))) -> Path:
    """Falcon-H1: every layer runs a Mamba2 mixer and attention (full RoPE) in parallel on the same
    normed input, then a SwiGLU MLP. Every muP multiplier is set away from 1 (each one a runtime
    could forget), and the Mamba gate / norm order is one of its three options."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = FalconH1Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, mamba_d_ssm=MAMBA_HEADS * MAMBA_HEAD_DIM, mamba_n_heads=MAMBA_HEADS,
        mamba_d_head=MAMBA_HEAD_DIM, mamba_n_groups=2, mamba_d_state=SSM_STATE, mamba_d_conv=CONV_K,
        mamba_chunk_size=CHUNK, mamba_rms_norm=rms_norm, mamba_norm_before_gate=norm_before_gate,
        time_step_limit=tuple(time_step_limit), rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        embedding_multiplier=1.7, lm_head_multiplier=0.8, key_multiplier=0.7, attention_in_multiplier=1.3,
        attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.85,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 0.7], mlp_multipliers=[1.2, 0.75],
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = FalconH1ForCausalLM(cfg).to(torch.float32).eval()
    _redraw_weights(model, seed)
    return _finish(model, path)


def build_zamba2(path, *, vocab_size: int = 176, seed: int = 8,
                 layers=("hybrid", "mamba", "hybrid", "mamba", "mamba", "hybrid"), num_mem_blocks: int = 2,
                 attention_adapters: bool = True, mem_rope: bool = False, n_kv_heads: int = N_HEADS,
                 dt_floor_heads: bool = False, dt_range=(1e-3, 0.2), query_scale: float = 0.4,
                 bias: bool = False) -> Path:
    """Zamba2: Mamba2 layers; each "hybrid" layer first runs a shared attention + gelu MLP block on
    cat(h, embeddings) (block j % num_mem_blocks, weights stored once) with its own LoRA adapters
    (gate|up always, q/k/v optionally) and its own linear, whose output joins the Mamba input only."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    cfg = Zamba2Config(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=len(layers), layers_block_type=list(layers),
        mamba_d_state=SSM_STATE, mamba_d_conv=CONV_K, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=MAMBA_HEADS,
        chunk_size=CHUNK, intermediate_size=96, hidden_act="gelu", num_attention_heads=N_HEADS,
        num_key_value_heads=n_kv_heads, num_mem_blocks=num_mem_blocks,
        use_shared_attention_adapter=attention_adapters, adapter_rank=8, use_mem_rope=mem_rope,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5, time_step_min=1e-3, tie_word_embeddings=True, add_bias_linear=bias,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(seed)
    model = Zamba2ForCausalLM(cfg).to(torch.float32).eval()
    # the residual branches are scaled up so that they are not drowned by the (unit-scale) embedding,
    # which would make the model repeat one token; tied logits are kept from over-sharpening by a
    # smaller final-norm weight
    _redraw_weights(model, seed, dt_floor_heads=dt_floor_heads, dt_range=dt_range, branch_out_scale=2.5,
                    final_norm_scale=0.5)
    scale_zamba2_queries(model, query_scale)
    model.tie_weights()
    return _finish(model, path)


@torch.no_grad()
def scale_zamba2_queries(model: torch.nn.Module, scale: float) -> None:
    """Zamba2's attention scale (head_dim / 2)^-0.5 and its q adapters make the scores large (a
    near-one-hot softmax, which amplifies rounding noise past the logprob tolerances): the shared
    blocks' q projections (and the q adapters' up projections) times `scale`."""
    for name, t in model.named_parameters():
        if "q_proj" in name or ("linear_q_adapter_list" in name and name.endswith(".1.weight")):
            t.mul_(scale)


def hubify_zamba2(cfg: dict) -> None:
    # Hub Zamba2 configs use the legacy "mamba" name for Mamba layers.
    cfg["layers_block_type"] = ["mamba" if t == "linear_attention" else t for t in cfg["layers_block_type"]]


def build_zamba2_hub_config(path, **kwargs) -> Path:
    p = build_zamba2(path, **kwargs)
    rewrite_config(p, hubify_zamba2)
    return p


# ----------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
_MERGE_PAIRS = [
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of",
    "ed", "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le",
    "ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne", "ea", "ra", "ce", "li", "ch", "ll",
    "be", "ma", "si", "om", "ur", "ca", "el", "ta", "la", "ns", "di", "fo", "ho", "pe", "ec",
    "pr", "no", "ct", "us", "ac", "ot", "il", "tr", "ly", "nc", "et", "ut", "ss", "so", "rs",
    "un", "lo", "wa", "ge", "ie", "wh", "ee", "wi", "em", "ad", "ol", "rt", "po", "we", "na",
    "ul", "ni", "ts", "mo", "ow", "pa", "im", "mi", "ai", "sh", "ir", "su", "id", "os", "iv",
]


def write_char_bpe_tokenizer(path, vocab_size: int) -> None:
    """Write tokenizer.json (+ tokenizer_config.json) whose vocab has exactly `vocab_size` ids.

    ids 0..3 are <pad> <s> </s> <unk>; then printable ASCII characters and "\\n"; then
    character bigram merges. No pre-tokenizer, no normalizer, no post-processor (encode()
    adds no special tokens), Fuse decoder: decode(ids) is the plain concatenation of the
    token strings, so text round-trips exactly for printable ASCII.
    """
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab: dict[str, int] = {}
    for tok in _SPECIALS + chars:
        vocab[tok] = len(vocab)
    merges = []
    for pair in _MERGE_PAIRS:
        if len(vocab) >= vocab_size:
            break
        vocab[pair] = len(vocab)
        merges.append((pair[0], pair[1]))
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build a tokenizer with exactly {vocab_size} ids (have {len(vocab)})")

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.add_special_tokens(_SPECIALS)
    tok.decoder = decoders.Fuse()
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POS,
    }, indent=2))


# ----------------------------------------------------------------------------------------
# hub-style config.json (what files on the Hub look like, as opposed to transformers 5.x saves)
# ----------------------------------------------------------------------------------------


def rewrite_config(path, fn) -> None:
    """Load config.json (accepting either infinity encoding), apply fn(dict) and write it
    back with Python's json (which writes float('inf') as the bare `Infinity` literal)."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text(), object_hook=_decode_float_tags)
    fn(cfg)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def _decode_float_tags(obj):
    if set(obj) == {"__float__"}:
        return float(obj["__float__"])
    return obj


def hubify_nemotron_h(cfg: dict) -> None:
    # Hub NemotronH configs spell the pattern as a string plus num_hidden_layers.
    rev = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}
    types = cfg.pop("layers_block_type")
    cfg["hybrid_override_pattern"] = "".join(rev[t] for t in types)
    cfg["num_hidden_layers"] = len(types)
    cfg.pop("mtp_layers_block_type", None)


def hubify_granite(cfg: dict) -> None:
    # Hub Granite 4.0-H configs use the legacy "mamba" / "attention" layer type names.
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [legacy.get(t, t) for t in cfg["layer_types"]]


# ----------------------------------------------------------------------------------------
# registry used by the fixtures
# ----------------------------------------------------------------------------------------


def build_nemotron_h_with_tokenizer(path) -> Path:
    """NemotronH + tokenizer.json. The lm_head rows of <pad>, <s>, <unk> are zeroed so greedy
    decoding never emits them (keeps `.text` comparisons free of special-token handling)."""
    vocab = 160
    p = build_nemotron_h(path, vocab_size=vocab, seed=1, zero_logit_ids=(PAD_ID, BOS_ID, UNK_ID))
    write_char_bpe_tokenizer(p, vocab)
    # hub-style config: hybrid_override_pattern string and a bare `Infinity` literal
    rewrite_config(p, hubify_nemotron_h)
    return p


def build_granite_moe_hub_config(path, **kwargs) -> Path:
    p = build_granite_hybrid(path, moe=True, **kwargs)
    rewrite_config(p, hubify_granite)
    return p


BUILDERS = {
    # name: (builder, kwargs)
    "nemotron_h": (build_nemotron_h_with_tokenizer, {}),
    "granite_dense": (build_granite_hybrid, {"moe": False, "seed": 2}),
    # (config.json with the legacy "mamba"/"attention" layer type names)
    "granite_moe": (build_granite_moe_hub_config, {"seed": 4}),
    # finite time_step_limit: the prefill (chunked) path clamps dt to it, decode does not
    "bamba": (build_bamba, {"seed": 3, "time_step_limit": (0.0, 0.15)}),
    # Falcon-H1: parallel Mamba + attention, muP multipliers; y * silu(z) without a norm (its default)
    "falcon_h1": (build_falcon_h1, {"seed": 6}),
    # ... and with the grouped norm before the gate, and a finite dt limit
    "falcon_h1_norm": (build_falcon_h1, {"seed": 7, "rms_norm": True, "norm_before_gate": True,
                                         "time_step_limit": (0.0, 0.15)}),
    # a second NemotronH with another pattern (attention first, then MoE), saved in
    # ~9 shards with model.safetensors.index.json; dt kept well above time_step_min so the
    # NemotronH prefill clamp never bites (separates clamp bugs from loading bugs)
    # Zamba2: 3 hybrid layers over 2 shared blocks, q/k/v and gate|up adapters, NoPE; a few dt far
    # below time_step_min (the prefill clamp bites, decode does not clamp)
    "zamba2": (build_zamba2, {"seed": 8, "dt_floor_heads": True}),
    # ... one shared block used 3 times, RoPE, grouped-query attention (no q/k/v adapters), biases
    # (add_bias_linear: Mamba in/out and MLP projections), dt well above the clamp, hub-style legacy
    # "mamba" layer names
    "zamba2_rope": (build_zamba2_hub_config, {"seed": 13, "layers": ("mamba", "hybrid", "hybrid", "mamba", "hybrid"),
                                              "num_mem_blocks": 1, "attention_adapters": False,
                                              "mem_rope": True, "n_kv_heads": N_KV_HEADS, "bias": True,
                                              "dt_range": (0.03, 0.3)}),
    "nemotron_h_sharded": (build_nemotron_h, {"pattern": "*EM-M", "vocab_size": 128, "seed": 5,
                                                "max_shard_size": "60KB",
                                                "dt_floor_heads": False, "dt_range": (0.03, 0.3)}),
    # LatentMoE as in Nemotron 3 Super: experts in a 32-wide latent, one routing group (the fused
    # router's path on CUDA), biases on the MLPs, the shared expert and the latent projections
    "nemotron_h_latent": (build_nemotron_h, {"pattern": "ME*EM-E", "vocab_size": 144, "seed": 9,
                                               "moe_latent_size": 32, "n_group": 1, "mlp_bias": True,
                                               "dt_floor_heads": False, "dt_range": (0.03, 0.3)}),
}


def build_every_expert(name: str, path) -> Path:
    """The MoE checkpoint `name` with every routed expert chosen for every token (top-k = E): the
    expert weights are then continuous in the router logits, so no rounding noise can flip a choice.
    For the GPU state-integrity scenarios, whose reference runs other kernels: in a tiny random MoE
    one flipped choice moves later logits by tenths of a nat, which would hide what they look for
    (corrupted state) behind noise. The fused expert path, its grouping and graphs are all still used."""
    p = build(name, path)

    def every_expert(cfg: dict) -> None:
        experts = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
        assert experts, f"{name} has no routed experts"
        cfg["num_experts_per_tok"] = experts
        if "n_group" in cfg:
            cfg["topk_group"] = cfg["n_group"]

    rewrite_config(p, every_expert)
    return p


# every family variant the parity tests cover
FAMILY_VARIANTS = list(BUILDERS)


def copy_checkpoint(src, tmp_path, name: str = "ckpt") -> Path:
    """A copy of checkpoint directory `src` under tmp_path/name, for a test to break or rewrite."""
    dst = Path(tmp_path) / name
    shutil.copytree(src, dst)
    return dst


def build(name: str, path) -> Path:
    fn, kwargs = BUILDERS[name]
    return fn(path, **kwargs)


def vocab_size_of(path) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])
