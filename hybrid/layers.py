"""Model layers. Each layer works on the flattened tokens of a StepBatch ([T, hidden]). The MoE layers,
built on these, are in hybrid/moe.py."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.batch import StepBatch
from hybrid.config import GATE_ONLY, GATE_THEN_NORM, AttentionConfig, MambaConfig
from hybrid.mamba_metadata import step_metadata
from hybrid.ops import mamba_torch, triton_act, triton_gemv, triton_moe, triton_norm
from hybrid.ops.triton_guard import decode_linear_plain, switch
from hybrid.step_cores import run_core


def _param(*shape: int) -> nn.Parameter:
    # Filled by the loader; "meta" keeps construction free of any allocation.
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, role: str = "") -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        # decode-sized steps through the one-launch Triton linear when HYBRID_DECODE_LINEAR=triton / plain
        # (hybrid/ops/triton_gemv.py; see use_fused_ops); "plain:<roles>" picks projections by role
        self.fused = False
        self.role = role  # e.g. "mamba.in_proj": what the projection is in its layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fused and (switch("decode_linear") or decode_linear_plain(self.role)
                            or triton_gemv.preload_everywhere(x.shape[0]))
                and triton_gemv.eligible(x, self.weight)):
            return triton_gemv.small_m_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
_CPU_WIDEN_BYTES = 64 * 2**20  # the fp32 slab of LM-head rows widened at once on CPU


def logits_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head, h [n, hidden] @ weight [vocab, hidden].T, with its output in fp32 whatever the
    model dtype. Rounding 16-bit logits would cost up to half a bf16 step of the logit itself:
    0.125 nats for logits of 16-32, more than a near-tie (CPU bf16 at 8K contexts: greedy flips of
    0.125 and 0.25 nats with bf16 logits, under 0.1 with fp32 ones). On CUDA cuBLAS writes the fp32
    accumulator directly (torch >= 2.8); on CPU the operands are widened, the weight a slab of
    rows at a time (a whole fp32 copy of a 131072-row head would be GiBs)."""
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(h, weight)
    if switch("bf16_logits"):  # HYBRID_16BIT_LOGITS=1, on any device: 16-bit logits, widened after
        return F.linear(h, weight).float()
    if (switch("lm_head_preload") and triton_gemv.preload_everywhere(h.shape[0]) and h.dim() == 2
            and triton_gemv.eligible(h, weight)):  # one-token steps (HYBRID_LM_HEAD_PRELOAD=0: cuBLAS): fp32 out
        out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
        return triton_gemv.small_m_linear(h, weight, out=out, preload=True)
    if h.is_cuda and _MM_OUT_DTYPE and h.dtype == weight.dtype and h.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(h, weight.t(), out_dtype=torch.float32)
    if h.is_cuda:
        return F.linear(h, weight).float()  # older torch: 16-bit logits
    h32 = h.float()
    rows = max(1, _CPU_WIDEN_BYTES // (4 * weight.shape[1]))
    if rows >= weight.shape[0]:
        return F.linear(h32, weight.float())
    out = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        out[:, start:start + rows] = F.linear(h32, weight[start:start + rows].float())
    return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, weight_in_fp32: bool) -> None:
        super().__init__()
        self.weight = _param(size)
        self.eps = eps
        # NemotronH multiplies by the weight before casting back; the other families after.
        self.weight_in_fp32 = weight_in_fp32
        self.fused = False  # one Triton launch instead of the torch op chain (see use_fused_ops)
        # The FP8 projections that alone read this norm's output (set by use_fused_ops from the blocks'
        # norm_consumers): when they would round it with quantize_rows, the fused launch rounds it too
        self.fp8_consumers: tuple[nn.Module, ...] = ()

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x * scale), residual + x * scale); residual None starts the stream at x.
        The fused path updates `residual` in place. `x` may be an MoE layer's ExpertRows (their sum
        over k not taken yet): the fused path folds the sum into the same launch."""
        if isinstance(x, triton_moe.ExpertRows):
            if self.fused and residual is not None:
                return triton_norm.sum_add_rms_norm(x, residual, self.weight, self.eps, self.weight_in_fp32, scale,
                                                    self._round_for(residual)), residual
            x = x.sum()
        if residual is None:
            return self(x), x
        if self.fused:
            return triton_norm.add_rms_norm(x, residual, self.weight, self.eps, self.weight_in_fp32, scale,
                                            self._round_for(residual)), residual
        residual = residual + (x * scale if scale != 1.0 else x)
        return self(residual), residual

    def _round_for(self, rows: torch.Tensor) -> triton_norm.RoundFor | None:
        """Whether the fused launch over `rows` [T, H] also rounds its output to e4m3 for fp8_consumers: when each
        would round it with quantize_rows first (Fp8Linear.rounds_rows_first) and all share one scheme (dynamic
        scales, or the same static scale)."""
        consumers = self.fp8_consumers
        if not consumers or rows.dim() != 2:
            return None
        scale = consumers[0].input_scale
        if all(c.input_scale is scale and c.rounds_rows_first(rows.shape[0], rows.dtype, rows.device)
               for c in consumers):
            return triton_norm.RoundFor(scale)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            x = x.contiguous()
            return triton_norm.rms_norm(x, self.weight, self.eps, self.weight_in_fp32, self._round_for(x))
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * h).to(dtype)
        return self.weight * h.to(dtype)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation, op for op
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def activation(name: str):
    """transformers' ACT2FN[name] (the names hybrid/config_fields._ACTIVATIONS accepts)."""
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu_new":
        return _gelu_new
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation '{name}'")


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer over a StepBatch: decodes (and verify / replay rows) use the recurrence, prefill
    chunks the chunked scan."""

    def __init__(self, hidden_size: int, cfg: MambaConfig, layer_index: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index  # index among Mamba layers: the row of the state pool
        inner, conv_dim, nh = cfg.intermediate_size, cfg.conv_dim, cfg.num_heads
        self.in_proj = Linear(hidden_size, inner + conv_dim + nh, cfg.proj_bias, role="mamba.in_proj")
        self.conv_weight = _param(conv_dim, cfg.conv_kernel)
        self.conv_bias = _param(conv_dim) if cfg.conv_bias else None
        self.A_log = _param(nh)
        self.D = _param(nh)
        self.dt_bias = _param(nh)
        self.norm_weight = None if cfg.gate == GATE_ONLY else _param(inner)
        self.out_proj = Linear(inner, hidden_size, cfg.out_bias, role="mamba.out_proj")
        self.conv_act = None if cfg.conv_act == "silu" else activation(cfg.conv_act)  # None: silu
        self.kernels = None  # set by the model when GPU kernels are in use
        self.fused = False  # gated norm as one Triton launch (see use_fused_ops)
        # Tensor parallelism with groups wider than a rank's channels: maps the local mean of squares
        # [T, G, 1] to the whole group's (hybrid/parallel/layers.py GroupNormStats); None: local is whole
        self.norm_stats = None

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The SSM output gated by silu(z) and RMS-normalised per group of inner/G channels, in fp32,
        in the order the checkpoint's family uses (MambaConfig.gate): norm(y * silu(z)) for most,
        norm(y) * silu(z) or y * silu(z) without a norm for Falcon-H1."""
        cfg = self.cfg
        if cfg.gate == GATE_ONLY:
            return (y.float() * F.silu(z.float())).to(z.dtype)
        if cfg.gate == GATE_THEN_NORM:
            if self.fused and self.norm_stats is None:
                return triton_norm.gated_rms_norm(y.contiguous(), z, self.norm_weight, cfg.norm_eps, cfg.n_groups)
            h = y.float() * F.silu(z.float())
        else:
            h = y.float()
        h = h.view(h.shape[0], cfg.n_groups, -1)
        mean_sq = h.pow(2).mean(-1, keepdim=True)
        if self.norm_stats is not None:
            mean_sq = self.norm_stats(mean_sq)
        h = h * torch.rsqrt(mean_sq + cfg.norm_eps)
        h = h.view(h.shape[0], -1)
        if cfg.gate == GATE_THEN_NORM:
            return self.norm_weight * h.to(self.norm_weight.dtype)
        return (self.norm_weight * h * F.silu(z.float())).to(z.dtype)  # Falcon-H1 order: weight, then gate

    def project_out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(gated_norm(y, z)) in `dtype`. A decode-sized step on the Triton linear
        (HYBRID_DECODE_LINEAR=triton) with the norm-then-weight gate takes both in one launch
        (triton_gemv.gated_norm_linear), unless tensor parallelism splits the groups or the projection."""
        cfg, proj = self.cfg, self.out_proj
        if (self.fused and type(proj) is Linear and proj.fused and self.norm_stats is None
                and cfg.gate == GATE_THEN_NORM and switch("decode_linear") and triton_gemv.eligible(z, proj.weight)
                and self.norm_weight.dtype == dtype == proj.weight.dtype and y.stride(-1) == 1
                and triton_gemv.gated_norm_block_k(cfg.intermediate_size // cfg.n_groups) is not None):
            return triton_gemv.gated_norm_linear(y, z, self.norm_weight, cfg.norm_eps, cfg.n_groups, proj.weight,
                                                 proj.bias)
        return proj(self.gated_norm(y, z).to(dtype))

    def forward(self, hidden: torch.Tensor, batch: StepBatch, conv_state: torch.Tensor,
                ssm_state: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if self.kernels is not None and (not batch.num_verify or getattr(self.kernels, "supports_verify", False)):
            return self.kernels.mamba_forward(self, hidden, batch, conv_state, ssm_state)
        inner, conv_dim, nh, P = cfg.intermediate_size, cfg.conv_dim, cfg.num_heads, cfg.head_dim
        zxbcdt = self.in_proj(hidden)
        z, xBC, dt = torch.split(zxbcdt, [inner, conv_dim, nh], dim=-1)
        core = functools.partial(self._mix, conv_state=conv_state, ssm_state=ssm_state)
        y = run_core(core, batch, (xBC, dt), (nh, P), torch.float32)
        return self.project_out(y.reshape(-1, inner), z, hidden.dtype)

    def _mix(self, batch: StepBatch, xBC: torch.Tensor, dt: torch.Tensor, *, conv_state: torch.Tensor,
             ssm_state: torch.Tensor) -> torch.Tensor:
        """The layer's core (hybrid/step_cores.py): conv and scan of every row kind, the slots' state writes.
        Returns y [T, heads, head_dim] in fp32."""
        cfg = self.cfg
        inner, nh, P = cfg.intermediate_size, cfg.num_heads, cfg.head_dim
        gn = cfg.n_groups * cfg.state_size
        A = -torch.exp(self.A_log.float())
        y = torch.empty(xBC.shape[0], nh, P, dtype=torch.float32, device=xBC.device)

        nd = batch.num_decodes
        if nd:
            y[:nd] = self._recurrence_step(xBC[:nd], dt[:nd], A, conv_state, ssm_state, batch.state_slot[:nd])

        if batch.num_verify:
            self._verify(xBC, dt, A, y, batch, conv_state, ssm_state)
        if batch.num_replay:
            self._replay(xBC, dt, A, y, batch, conv_state, ssm_state)

        for row in step_metadata(batch).prefills:  # built once per step, shared by every layer
            length, slot, has_init = row.length, row.slot, row.has_initial_state
            if slot < 0:  # padding row: touches no state
                continue
            rows = slice(row.start, row.start + length)
            xbc = mamba_torch.conv_prefill(xBC[rows], conv_state, slot, has_init, self.conv_weight, self.conv_bias,
                                           self.conv_act)
            x, B, C = torch.split(xbc, [inner, gn, gn], dim=-1)
            init = ssm_state[slot] if has_init else None
            out, final = mamba_torch.ssm_prefill(
                x.reshape(length, nh, P), dt[rows], A, B.reshape(length, cfg.n_groups, -1),
                C.reshape(length, cfg.n_groups, -1), self.D, self.dt_bias, cfg.dt_limit, cfg.chunk_size, init,
            )
            ssm_state[slot] = final.to(ssm_state.dtype)
            y[rows] = out
            row.keep_snapshot(conv_state, ssm_state)  # a prefix-cache snapshot: the state after this segment
        return y

    def _recurrence_step(self, xBC: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, conv_buf: torch.Tensor,
                         ssm_buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """One token per row through the decode recurrence (conv window, then the state update, no dt
        clamp), on state rows `index` of the buffers (slots, or verify scratch rows). Returns y [n, H, P]."""
        cfg = self.cfg
        n, gn = xBC.shape[0], cfg.n_groups * cfg.state_size
        xbc = mamba_torch.conv_decode(xBC, conv_buf, index, self.conv_weight, self.conv_bias, self.conv_act)
        x, B, C = torch.split(xbc, [cfg.intermediate_size, gn, gn], dim=-1)
        return mamba_torch.ssm_decode(
            x.reshape(n, cfg.num_heads, cfg.head_dim), dt, A, B.reshape(n, cfg.n_groups, -1),
            C.reshape(n, cfg.n_groups, -1), self.D, self.dt_bias, ssm_buf, index,
        ).float()

    def _verify(self, xBC: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor, batch: StepBatch,
                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Speculative verify rows: the decode recurrence token by token (exactly the decode path's
        math), starting from each row's slot and keeping the state after every token in the verify
        scratch; the slots themselves are not written (the engine commits the accepted position).
        The token positions (token rows, slots, flat scratch rows) come from the step's metadata."""
        conv_scr = batch.state_scratch[0][self.layer_index]  # [rows, K+1, C, W]
        ssm_scr = batch.state_scratch[1][self.layer_index]  # [rows, K+1, H, P, N]
        conv_flat = conv_scr.view(-1, *conv_scr.shape[2:])
        ssm_flat = ssm_scr.view(-1, *ssm_scr.shape[2:])
        for j, pos in enumerate(step_metadata(batch).verify_positions):
            tok, dst = pos.tokens, pos.scratch
            if j == 0:
                conv_flat[dst] = conv_state[pos.slots]
                ssm_flat[dst] = ssm_state[pos.slots]
            else:
                conv_flat[dst] = conv_flat[dst - 1]
                ssm_flat[dst] = ssm_flat[dst - 1]
            y[tok] = self._recurrence_step(xBC[tok], dt[tok], A, conv_flat, ssm_flat, dst)

    def _replay(self, xBC: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor, batch: StepBatch,
                conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Replay rows (a readmitted sequence's known generated tokens): the decode recurrence token by
        token on each row's own slot, in place, exactly the decode branch's math (no dt clamp), batched
        across the rows still active at each token position (the step's metadata)."""
        for pos in step_metadata(batch).replay_positions:
            y[pos.tokens] = self._recurrence_step(xBC[pos.tokens], dt[pos.tokens], A, conv_state, ssm_state,
                                                  pos.slots)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LowRankAdapter(nn.Module):
    """Zamba2's per-use adapters of a shared projection (LoRA-shaped): for each of `parts` output
    sections of `part_size` columns, up_p(down_p(x)); the down projections run as one GEMM. Added to the
    shared projection's output at run time, so the shared weights stay stored once."""

    def __init__(self, in_features: int, rank: int, parts: int, part_size: int) -> None:
        super().__init__()
        self.parts, self.rank = parts, rank
        self.down = _param(parts * rank, in_features)  # [down_0 | down_1 | ...] rows
        self.up = _param(parts, part_size, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.down)
        if self.parts == 1:
            return F.linear(h, self.up[0])
        h = h.view(x.shape[0], self.parts, self.rank).transpose(0, 1)  # [parts, T, rank]
        return torch.bmm(h, self.up.transpose(1, 2)).transpose(0, 1).reshape(x.shape[0], -1)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, cfg: AttentionConfig, layer_index: int,
                 out_features: int | None = None) -> None:
        """`out_features`: the o_proj width if not `hidden_size` (Zamba2 attends over 2H-wide inputs and
        writes H)."""
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index  # index among attention layers: the row of the KV cache
        # FP8 KV cache (kv_cache_dtype="fp8"): the cache stores k / k_scale and v / v_scale; 1.0 unless
        # the checkpoint calibrated them (hybrid/kv_cache_dtype.py)
        self.k_scale, self.v_scale = 1.0, 1.0
        hd = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, cfg.bias,
                               role="attn.qkv_proj")  # [q | k | v] rows
        self.o_proj = Linear(cfg.num_heads * hd, out_features or hidden_size, cfg.bias, role="attn.o_proj")
        if cfg.rope_theta is not None:
            # transformers' default RoPE: frequencies arange(0, dim, 2) / dim of dim = rotary_dim, each
            # rotating a pair of dims (an odd rotary_dim rotates rotary_dim + 1 of them)
            dim = cfg.rotary_dim
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
        else:
            self.inv_freq = None

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(q.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        d = self.cfg.rotary_width

        def apply(t: torch.Tensor) -> torch.Tensor:
            rot, rest = t[..., :d], t[..., d:]
            return torch.cat(((rot * cos) + (rotate_half(rot) * sin), rest), dim=-1)

        return apply(q), apply(k)

    def forward(self, hidden: torch.Tensor, batch: StepBatch, kv_layer: torch.Tensor, backend,
                adapter: LowRankAdapter | None = None) -> torch.Tensor:
        """`adapter`: added to the [q | k | v] projection (Zamba2's per-layer adapters of a shared block)."""
        cfg = self.cfg
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if adapter is not None:
            qkv = qkv + adapter(hidden)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        core = functools.partial(self._attend, kv_layer=kv_layer, backend=backend)
        return self.o_proj(run_core(core, batch, (q, k, v), (self.q_size,), q.dtype))

    def _attend(self, batch: StepBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                kv_layer: torch.Tensor, backend) -> torch.Tensor:
        """The layer's core (hybrid/step_cores.py): rope at the batch's positions, the KV write and the attention
        over each request's pages. Returns [T, heads x head_dim]."""
        if self.inv_freq is not None:
            q, k = self.rope(q, k, batch.positions)
        return backend.forward(q, k, v, kv_layer, batch, self.cfg.scale, (self.k_scale, self.v_scale))


class DenseMLP(nn.Module):
    """relu2 MLP (NemotronH '-' layers and shared experts): down(act(up(x)))."""

    def __init__(self, hidden_size: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate, bias, role="mlp.up_proj")
        self.down_proj = Linear(intermediate, hidden_size, bias, role="mlp.down_proj")
        self.act = activation(act)
        self.fused = False  # relu2 as one Triton launch (see use_fused_ops)
        self.can_fuse = act == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.fused and getattr(self.down_proj, "takes_mlp_activation", False):
            return self.down_proj(h, act="relu2")  # an FP8 down_proj: relu2 in the launch rounding its rows
        return self.down_proj(triton_act.relu2(h) if self.fused else self.act(h))


class GatedMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), gate and up fused in one [2I, H] weight ([gate | up])."""

    def __init__(self, hidden_size: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate, bias, role="mlp.gate_up_proj")
        self.down_proj = Linear(intermediate, hidden_size, bias, role="mlp.down_proj")
        self.act = activation(act)
        self.fused = False  # silu(gate) * up as one Triton launch (see use_fused_ops)
        self.can_fuse = act == "silu"

    def forward(self, x: torch.Tensor, adapter: LowRankAdapter | None = None) -> torch.Tensor:
        """`adapter`: added to the [gate | up] projection (Zamba2's per-layer adapter of a shared MLP)."""
        gate_up = self.gate_up_proj(x)
        if adapter is not None:
            gate_up = gate_up + adapter(x)
        if self.fused and getattr(self.down_proj, "takes_mlp_activation", False):
            return self.down_proj(gate_up, act="silu_and_mul")  # an FP8 down_proj: SwiGLU in that launch
        if self.fused:
            return self.down_proj(triton_act.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
