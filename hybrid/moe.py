"""MoE layers: the routed experts (`Experts`: the torch loop over the chosen experts, the CPU
reference, or the Triton grouped GEMMs of hybrid/ops/triton_moe.py), NemotronH's and Granite's MoE
layers with their routers (hybrid/ops/triton_moe_route.py on the fused path), and `add_norm_route`
(the norm before an MoE layer, with the layer's routing in the same launch where it can). Like
hybrid/layers.py, each works on the flattened tokens of a StepBatch ([T, hidden])."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.config import MoEConfig
from hybrid.layers import DenseMLP, GatedMLP, Linear, RMSNorm, _param, activation
from hybrid.ops import triton_moe, triton_moe_route, triton_norm
from hybrid.ops.triton_guard import switch


class Experts(nn.Module):
    """Routed experts as stacked weights: up [E, I or 2I, H], down [E, H, I].

    The torch loop over the chosen experts is the CPU reference; on CUDA (`fused`) one Triton
    grouped GEMM per projection runs instead (hybrid/ops/triton_moe.py): no host sync, fixed launch
    shapes, so MoE models decode under CUDA graphs.

    FP8 experts (an FP8 checkpoint's experts as the loader keeps them on CUDA, hybrid/loader.py): up
    and down in float8_e4m3fn with `up_scale` / `down_scale` [E, rows] fp32, one scale per output
    row. They stream half the bytes of bf16 experts; the activations stay in the model dtype
    (weight-only), so the result is the dequantized weights' (w.float() * scale) up to rounding.
    The torch loop dequantizes each chosen expert as the load-time dequantization would."""

    can_defer_sum = True  # not when the output is reduced across ranks first (ParallelExperts)

    def __init__(self, hidden_size: int, cfg: MoEConfig, act: str, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.top_k = cfg.top_k  # routed experts per token
        width = 2 * cfg.intermediate_size if gated else cfg.intermediate_size
        self.up = _param(cfg.num_experts, width, hidden_size)
        self.down = _param(cfg.num_experts, hidden_size, cfg.intermediate_size)
        self.act = activation(act)
        self.fused = False  # the Triton grouped-GEMM path (see use_fused_ops)
        self.can_fuse = act == ("silu" if gated else "relu2")
        self.defer_sum = False  # fused path: return ExpertRows, summed by the next norm (see use_fused_ops)
        self.register_buffer("up_scale", None)  # FP8 experts: per-row scales (see the class docstring)
        self.register_buffer("down_scale", None)

    @property
    def fp8(self) -> bool:
        return self.up_scale is not None

    def _weight(self, which: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's up or down weight in `dtype` (FP8 experts: dequantized with their row scales)."""
        w = getattr(self, which)[e]
        scale = getattr(self, f"{which}_scale")
        return w if scale is None else (w.float() * scale[e][:, None]).to(dtype)

    def shared_slices(self, shared: nn.Module | None, num_tokens: int) -> int:
        """How many expert-wide slices the shared expert `shared` joins the fused launches as (0: it
        runs on its own): on the fused path, for steps of few tokens (triton_moe.SHARED_FOLD_MAX_TOKENS),
        for a bias-free shared MLP of this activation whose width is a multiple of the expert width."""
        if not self.fused or shared is None or not shared.can_fuse or num_tokens > triton_moe.SHARED_FOLD_MAX_TOKENS:
            return 0
        up = shared.gate_up_proj if self.gated else shared.up_proj
        if isinstance(shared, GatedMLP) != self.gated or up.bias is not None or shared.down_proj.bias is not None:
            return 0
        if type(up) is not Linear or type(shared.down_proj) is not Linear:  # FP8 projections run on their own
            return 0
        if shared.down_proj.weight.shape[0] != self.down.shape[1]:  # LatentMoE: experts of another width
            return 0
        if self.fp8:  # the kernel streams one weight dtype a launch
            return 0
        width, inter = shared.down_proj.weight.shape[1], self.down.shape[2]
        return width // inter if width % inter == 0 else 0

    def warmup_lengths(self, shared: nn.Module | None, max_tokens: int, element_size: int, sms: int) -> list[int]:
        """Step lengths (at most max_tokens) that between them meet every Triton specialisation this
        layer's fused experts can compile: for each distinct triton_moe.launch_plan, the shortest step
        that has it (`shared`: the MLP the layer passes as its shared expert; element_size: the
        activations'). Why: the plan (alignment method, tiles, narrowing, shared slices) changes with
        the step's size at thresholds that depend on the expert count, so a warm-up of a few fixed
        lengths missed some (a 512-token prompt of Nemotron-3-Nano compiled after startup)."""
        E, _, hidden = self.up.shape
        inter = self.down.shape[2]
        first: dict[tuple, int] = {}
        for T in range(1, max_tokens + 1):
            plan = triton_moe.launch_plan(T, self.top_k, E, self.shared_slices(shared, T), hidden, inter,
                                          self.gated, element_size, sms, self.fp8)
            first.setdefault(plan, T)
        return sorted(first.values())

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor | None, top_w: torch.Tensor | None,
                add: torch.Tensor | None = None, shared: nn.Module | None = None,
                router: triton_moe_route.RouterLogits | None = None) -> torch.Tensor:
        """sum_k top_w * expert_k(x) (+ add), in x.dtype. `shared` (fused path only, see
        shared_slices): the shared MLP as pseudo-experts E.., whose ids and weights (1) are the
        last columns of top_idx / top_w. `router` (fused path only, top_idx / top_w None): the router's
        logits, routed by the fused experts (inside their GEMMs at one token)."""
        if self.fused:
            s_up = s_down = None
            if shared is not None:
                s_up = (shared.gate_up_proj if self.gated else shared.up_proj).weight
                s_down = shared.down_proj.weight
            return triton_moe.fused_experts(x, self.up, self.down, top_idx, top_w, self.gated, add,
                                            shared_up=s_up, shared_down=s_down, defer_sum=self.defer_sum,
                                            up_scale=self.up_scale, down_scale=self.down_scale, router=router)
        assert shared is None and router is None, "the shared expert and a router join the experts only when fused"
        out = torch.zeros(x.shape[0], x.shape[1], dtype=top_w.dtype, device=x.device)
        for e in torch.unique(top_idx).tolist():
            token, k = torch.where(top_idx == e)
            h = F.linear(x[token], self._weight("up", e, x.dtype))
            if self.gated:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            h = F.linear(h, self._weight("down", e, x.dtype)) * top_w[token, k, None]
            out.index_add_(0, token, h.to(out.dtype))
        out = out.to(x.dtype)
        return out + add if add is not None else out


class NemotronMoE(nn.Module):
    """Sigmoid router with grouped top-k and score correction bias, relu2 experts, one shared expert.

    LatentMoE (cfg.latent_size, Nemotron 3 Super): the routed experts read and write a narrower
    latent width. `latent_in_proj` takes the layer's input down to it, `latent_out_proj` takes the
    experts' weighted sum back up, and the router and the shared expert read the full-width input."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, act: str, shared_bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.router_weight = _param(cfg.num_experts, hidden_size)
        self.router_bias = _param(cfg.num_experts)  # e_score_correction_bias, fp32
        latent = cfg.latent_size
        self.latent_in_proj = self.latent_out_proj = None
        if latent is not None:  # (their bias is mlp_bias, as the shared expert's)
            self.latent_in_proj = Linear(hidden_size, latent, bias=shared_bias)
            self.latent_out_proj = Linear(latent, hidden_size, bias=shared_bias)
        self.experts = Experts(latent or hidden_size, cfg, act, gated=False)
        if latent is not None:
            # the projection back up needs the experts' sum, so the next norm cannot take their rows
            self.experts.can_defer_sum = False
        self.shared = DenseMLP(hidden_size, cfg.shared_intermediate_size, act, bias=shared_bias)  # (mlp_bias)

    def router_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, int, dict] | None:
        """(router weight, k, keyword arguments) of triton_moe_route.route_hidden for this router, or None
        where the Triton routing does not apply (the torch path; group masking)."""
        cfg = self.cfg
        if not (self.experts.fused and cfg.topk_group == cfg.n_group):
            return None
        return self.router_weight, cfg.top_k, dict(logits_dtype=torch.float32, sigmoid=True, bias=self.router_bias,
                                                   normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)

    def route(self, x: torch.Tensor, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_idx, top_w) [T, k + num_shared]: the routed experts, then the shared expert's slices
        (ids E.., weight 1; see Experts.shared_slices). The torch router (group masking); the fused path
        routes in the experts' launches (forward)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.router_weight.float())
        scores = logits.sigmoid()
        choice = scores + self.router_bias.float()
        n = x.shape[0]
        per_group = cfg.num_experts // cfg.n_group
        group_scores = choice.view(n, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        expert_mask = group_mask[:, :, None].expand(n, cfg.n_group, per_group).reshape(n, -1)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        top_idx = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_idx)
        if cfg.norm_topk_prob:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        top_w = top_w * cfg.routed_scaling_factor
        if num_shared:
            ids = torch.arange(cfg.num_experts, cfg.num_experts + num_shared, device=x.device)
            top_idx = torch.cat([top_idx, ids.expand(n, num_shared)], dim=1)
            top_w = torch.cat([top_w, top_w.new_ones(n, num_shared)], dim=1)
        return top_idx, top_w

    def forward(self, x: torch.Tensor, routing: triton_moe_route.RouterLogits | None = None) -> torch.Tensor:
        """`routing`: the router logits already computed with the norm before (add_norm_route)."""
        slices = self.experts.shared_slices(self.shared, x.shape[0])
        top_idx = top_w = None
        router = routing
        if router is None:
            args = self.router_args(x.dtype)
            if args is not None:  # no group masking: routed by the fused experts
                weight, top_k, kw = args
                router = triton_moe_route.router_logits(x, weight, top_k, num_shared=slices, **kw)
            else:
                top_idx, top_w = self.route(x, slices)
        if self.latent_in_proj is not None:  # (slices is 0: the shared expert is not of the latent width)
            routed = self.experts(self.latent_in_proj(x), top_idx, top_w, router=router)
            return self.latent_out_proj(routed) + self.shared(x)
        if slices:
            return self.experts(x, top_idx, top_w, shared=self.shared, router=router)
        return self.experts(x, top_idx, top_w, add=self.shared(x), router=router)


class GraniteMoE(nn.Module):
    """Softmax-over-top-k router with SwiGLU experts (the shared MLP is added by the block)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, act: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.router_weight = _param(cfg.num_experts, hidden_size)
        self.experts = Experts(hidden_size, cfg, act, gated=True)

    def router_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, int, dict] | None:
        """(router weight, k, keyword arguments) of triton_moe_route.route_hidden for activations of
        `dtype`, or None on the torch path."""
        if not self.experts.fused:
            return None
        return self.router_weight, self.cfg.top_k, dict(logits_dtype=dtype, sigmoid=False)

    def forward(self, x: torch.Tensor, shared: nn.Module | None = None,
                routing: triton_moe_route.RouterLogits | None = None) -> torch.Tensor:
        """The routed experts' output plus the block's shared MLP `shared` (if any). `routing`: the
        router logits already computed with the norm before (add_norm_route)."""
        if self.experts.fused:  # Triton routing; the shared MLP inside the expert launches if it fits
            slices = self.experts.shared_slices(shared, x.shape[0])
            top_idx = top_w = None
            router = routing
            if router is None:  # routed by the fused experts
                weight, top_k, kw = self.router_args(x.dtype)
                router = triton_moe_route.router_logits(x, weight, top_k, num_shared=slices, **kw)
            if slices:
                return self.experts(x, top_idx, top_w, shared=shared, router=router)
            return self.experts(x, top_idx, top_w, add=shared(x) if shared is not None else None, router=router)
        else:
            logits = F.linear(x, self.router_weight)
            top_logits, top_idx = logits.float().topk(self.cfg.top_k, dim=-1)
            top_w = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return self.experts(x, top_idx, top_w, add=shared(x) if shared is not None else None)


def add_norm_route(norm: RMSNorm, x, residual: torch.Tensor | None, scale: float, moe: nn.Module,
                   shared: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor, triton_moe_route.RouterLogits | None]:
    """norm.add_norm(x, residual, scale) before an MoE layer `moe` (whose shared MLP is `shared`),
    plus the layer's router logits when they were computed in the same launch: with the "norm_router"
    switch on (HYBRID_NORM_ROUTER=1), the Triton router and a step of few tokens, the add and norm run
    inside the router's split-K launch (triton_norm.add_rms_norm_router). Returns (x, residual,
    router logits or None), for moe(x, ..., routing=...), whose experts route them (the routing launch,
    or inside their first GEMM: triton_moe.fused_experts)."""
    if (switch("norm_router") and norm.fused and residual is not None and isinstance(x, torch.Tensor)
            and 0 < x.shape[0] <= triton_moe_route.ROUTER_FUSED_MAX_TOKENS and x.stride(-1) == 1):
        args = moe.router_args(residual.dtype)
        if args is not None:
            weight, top_k, kw = args
            route_scale = kw.pop("scale", 1.0)  # (router_logits' `scale` is the routing weights')
            slices = moe.experts.shared_slices(shared, x.shape[0])
            normed, residual, router = triton_norm.add_rms_norm_router(
                x, residual, norm.weight, norm.eps, norm.weight_in_fp32, scale, weight, top_k, num_shared=slices,
                route_scale=route_scale, **kw)
            return normed, residual, router
    x, residual = norm.add_norm(x, residual, scale)
    return x, residual, None
