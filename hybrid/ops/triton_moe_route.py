"""Top-k routing of the MoE layers (Triton): the (top_idx, top_w) that the fused experts
(hybrid/ops/triton_moe.py) take, one token per program of the routing launch.

- `route(logits, top_k, *, sigmoid, ...)`: from router logits [T, E] in one launch. sigmoid:
  NemotronH (experts chosen by sigmoid(logit) + correction bias, weighted by sigmoid(logit),
  optionally normalised over the k, times `scale`); else Granite (the top-k logits, softmax over
  them). `num_shared` more columns carry the shared expert's slices (ids E.., weight 1).
- `route_hidden(x, weight, top_k, *, logits_dtype, ...)`: the same from the hidden states, the
  router logits x @ weight.T computed as the reference does in `logits_dtype`: for steps of at most
  ROUTER_FUSED_MAX_TOKENS tokens in split-K partial sums (`_router_partial_kernel`) that the
  routing launch adds in a fixed order (no atomics), else a GEMM and `route`.
- `router_logits(x, weight, top_k, ...)`: route_hidden's logits (or partials) not yet routed, a
  `RouterLogits`: its `route()` is the routing launch, and the fused experts may route a one-token step
  inside their first GEMM instead (`route_token`, inlined there: one launch fewer a MoE layer).
- `router_split`, `router_tiling`, `partials_router`: the split-K launch's program setup, tiling and
  its partials as a RouterLogits, shared with triton_norm.add_rms_norm_router (the residual add and
  norm before an MoE layer computed inside its router's launch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.ops.triton_guard import HAS_TRITON, pdl_options, require, tl, triton
from state_pool.util import cdiv


if HAS_TRITON:
    from hybrid.ops.triton_guard import pdl_wait

    @triton.jit
    def router_split(w_ptr, s_w, E, K, k_per_split, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (t, e block, split) of a split-K router launch over the router weight [E, K]:
        (offs_e, e_ok, k_begin, k_end, w_rows, wv) with wv its first [BLOCK_E, BLOCK_K] weight tile in
        fp32 (usually its only one), read at once: no kernel writes the weight, so before the PDL wait."""
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        k_begin = tl.program_id(2) * k_per_split
        k_end = tl.minimum(k_begin + k_per_split, K)
        w_rows = w_ptr + offs_e[:, None].to(tl.int64) * s_w
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        wv = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & (offs_k < k_end)[None, :], other=0.0)
        return offs_e, e_ok, k_begin, k_end, w_rows, wv.to(tl.float32)

    @triton.jit(do_not_specialize=["T"])  # the step's token count: a new compile per value class otherwise
    def _router_partial_kernel(x_ptr, w_ptr, out_ptr, T, E, K, s_x, s_w, k_per_split,
                               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # partial[s, t, e] = sum over split s's slice of K of x[t, k] * w[e, k], in fp32. A step of few
        # tokens reads the router weight from many programs at once (a [T, E] GEMM has too few output
        # tiles to fill the GPU); _route_kernel adds the splits in a fixed order (no atomics).
        t = tl.program_id(0).to(tl.int64)
        offs_e, e_ok, k_begin, k_end, w_rows, wv = router_split(w_ptr, s_w, E, K, k_per_split, BLOCK_E, BLOCK_K)
        pdl_wait(PDL)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            if k0 > k_begin:
                wv = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + t * s_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
        tl.store(out_ptr + (tl.program_id(2) * T + t) * E + offs_e, acc, mask=e_ok)

    @triton.jit
    def route_bias(bias_ptr, E, EP: tl.constexpr, HAS_BIAS: tl.constexpr):
        """The correction bias [EP] in fp32 that route_token takes (zeros without HAS_BIAS). No kernel writes
        it: the kernels load it before their PDL wait (after it, it was one more read from HBM)."""
        e = tl.arange(0, EP)
        if HAS_BIAS:
            return tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        return tl.zeros([EP], dtype=tl.float32)

    @triton.jit
    def route_token(logits_ptr, bias, t, E, s_l, s_split, scale, TOP_K: tl.constexpr, KP: tl.constexpr,
                    EP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORMALIZE: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, ROUND: tl.constexpr):
        """Token t's routing: (top_idx [KP] int32, w [KP] fp32 times scale; entries past TOP_K unused).
        The k best experts by repeated argmax over the row (E <= a few hundred); KP and EP: k and E
        padded to powers of two; `bias` the correction bias (route_bias). The logits are the sum of
        NUM_SPLITS partial rows s_split apart (1: the logits themselves), rounded to bf16 (ROUND 1) or
        fp16 (2) first where the reference router computes in that dtype. Also inlined by the fused
        experts' first GEMMs (triton_moe: routing inside the GEMM at one token)."""
        e = tl.arange(0, EP)
        ok = e < E
        logits = tl.load(logits_ptr + t * s_l + e, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, NUM_SPLITS):
            logits += tl.load(logits_ptr + s * s_split + t * s_l + e, mask=ok, other=0.0)
        if ROUND == 1:
            logits = logits.to(tl.bfloat16).to(tl.float32)
        if ROUND == 2:
            logits = logits.to(tl.float16).to(tl.float32)
        logits = tl.where(ok, logits, float("-inf"))
        if SIGMOID:
            scores = 1.0 / (1.0 + tl.exp(-logits))
        else:
            scores = logits
        choice = scores
        if HAS_BIAS:
            choice = scores + bias
        choice = tl.where(ok, choice, float("-inf"))
        ks = tl.arange(0, KP)
        real = ks < TOP_K
        top_idx = tl.zeros([KP], dtype=tl.int32)
        top_s = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(choice, axis=0)
            top_idx = tl.where(ks == j, best, top_idx)
            top_s = tl.where(ks == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), top_s)
            choice = tl.where(e == best, float("-inf"), choice)
        if SIGMOID:
            w = top_s
            if NORMALIZE:
                w = w / (tl.sum(tl.where(real, w, 0.0), axis=0) + 1e-20)
        else:  # softmax over the k chosen logits
            top_s = tl.where(real, top_s, float("-inf"))
            w = tl.exp(top_s - tl.max(top_s, axis=0))
            w = w / tl.sum(w, axis=0)
        return top_idx, w * scale

    @triton.jit(do_not_specialize=["s_split"])  # T * E for split-K partials: batch-dependent
    def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, E, s_l, s_split, scale, TOP_K: tl.constexpr,
                      KP: tl.constexpr, EP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr, SP: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
        # One token per program (route_token). Output row: the k routed (id, weight), then the shared
        # pseudo-experts (E + s, 1.0).
        bias = route_bias(bias_ptr, E, EP, HAS_BIAS)
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        top_idx, w = route_token(logits_ptr, bias, t, E, s_l, s_split, scale, TOP_K, KP, EP, SIGMOID, HAS_BIAS,
                                 NORMALIZE, NUM_SPLITS, ROUND)
        ks = tl.arange(0, KP)
        real = ks < TOP_K
        row = t * (TOP_K + NUM_SHARED)
        tl.store(idx_ptr + row + ks, top_idx, mask=real)
        tl.store(w_ptr + row + ks, w, mask=real)
        if NUM_SHARED > 0:
            ss = tl.arange(0, SP)
            tl.store(idx_ptr + row + TOP_K + ss, E + ss, mask=ss < NUM_SHARED)
            tl.store(w_ptr + row + TOP_K + ss, tl.full([SP], 1.0, tl.float32), mask=ss < NUM_SHARED)


@dataclass
class RouterLogits:
    """A step's router logits, not yet routed: what route_token reads. `logits` holds `num_splits`
    partial sums [num_splits, T, E] (the split-K router launch's; their sum is the logits) or the
    logits [T, E] themselves (num_splits 1); `round_to` as route_token's ROUND; the rest as `route`.
    `route()` is the routing launch; the fused experts may instead route inside their first GEMM
    (triton_moe.fused_experts: one token), one launch fewer a layer."""

    logits: torch.Tensor
    T: int
    E: int
    s_row: int  # elements between two tokens' rows
    s_split: int  # elements between two partial sums
    num_splits: int
    round_to: int
    top_k: int
    sigmoid: bool
    bias: torch.Tensor | None
    normalize: bool
    scale: float
    num_shared: int

    @classmethod
    def of_logits(cls, logits: torch.Tensor, top_k: int, sigmoid: bool, bias: torch.Tensor | None, normalize: bool,
                  scale: float, num_shared: int) -> RouterLogits:
        """The router logits [T, E] themselves (last dim contiguous), to be routed."""
        T, E = logits.shape
        assert logits.stride(1) == 1 and top_k <= E
        return cls(logits, T, E, logits.stride(0), 0, 1, 0, top_k, sigmoid, bias, normalize, scale, num_shared)

    def route(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_idx, top_w) [T, top_k + num_shared]: the routing launch, one token a program."""
        width = self.top_k + self.num_shared
        dev = self.logits.device
        idx = torch.empty(self.T, width, dtype=torch.int32, device=dev)
        w = torch.empty(self.T, width, dtype=torch.float32, device=dev)
        if self.T:
            bias = self.bias
            _route_kernel[(self.T,)](
                self.logits, bias if bias is not None else self.logits, idx, w, self.E, self.s_row, self.s_split,
                self.scale, TOP_K=self.top_k, KP=triton.next_power_of_2(self.top_k),
                EP=triton.next_power_of_2(self.E), SIGMOID=self.sigmoid, HAS_BIAS=bias is not None,
                NORMALIZE=self.normalize, NUM_SHARED=self.num_shared,
                SP=triton.next_power_of_2(max(self.num_shared, 1)), NUM_SPLITS=self.num_splits,
                ROUND=self.round_to, num_warps=1 if self.E <= 256 else 4, **pdl_options(dev))
        return idx, w

    def kernel_args(self) -> tuple[tuple, dict]:
        """(runtime arguments, constexprs) of route_token for a kernel that inlines it."""
        args = (self.logits, self.bias if self.bias is not None else self.logits, self.s_row, self.s_split,
                float(self.scale))
        consts = dict(R_TOP_K=self.top_k, R_KP=triton.next_power_of_2(self.top_k), R_EP=triton.next_power_of_2(self.E),
                      R_SIGMOID=self.sigmoid, R_HAS_BIAS=self.bias is not None, R_NORMALIZE=self.normalize,
                      R_SPLITS=self.num_splits, R_ROUND=self.round_to)
        return args, consts


def route(logits: torch.Tensor, top_k: int, *, sigmoid: bool, bias: torch.Tensor | None = None,
          normalize: bool = False, scale: float = 1.0, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in one launch: (top_idx [T, k + num_shared] int32, top_w [T, k + num_shared] fp32)
    from router logits [T, E] (any float dtype). sigmoid: NemotronH (experts chosen by sigmoid(logit)
    + bias, weighted by sigmoid(logit), optionally normalised over the k, times `scale`); else
    Granite (the top-k logits, softmax over them). The last num_shared columns are the shared
    expert's slices for triton_moe.fused_experts: ids E .. E+num_shared-1, weight 1."""
    require(__name__)
    return RouterLogits.of_logits(logits, top_k, sigmoid, bias, normalize, scale, num_shared).route()


# Steps of at most this many tokens compute the router logits with _router_partial_kernel (split over
# the hidden size, so that even one token reads the router weight from many SMs), which the routing
# launch then sums: two launches in place of the GEMM (and for NemotronH's fp32 router, the cast of x)
# plus the routing one. Past it a [T, E] GEMM has tiles enough of its own.
ROUTER_FUSED_MAX_TOKENS = 16
# One [16, 64] weight tile per program (up to 64 K splits): the H200 profile of (32, 128, 8 splits)
# showed 6.7 us a layer for NemotronH's 1.4 MB fp32 router (28 programs, each looping over three
# tiles: latency-bound), no faster than the GEMM it replaced; bench/bench_router.py compares tilings.
_ROUTER_BLOCK_E, _ROUTER_BLOCK_K, _ROUTER_SPLITS = 16, 64, 64
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def route_hidden(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, logits_dtype: torch.dtype, sigmoid: bool,
                 bias: torch.Tensor | None = None, normalize: bool = False, scale: float = 1.0,
                 num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router logits x [T, H] @ weight [E, H].T computed as the reference does in
    `logits_dtype` (NemotronH: fp32 from fp32 x and weight; Granite: the model dtype, i.e. an fp32
    sum rounded once): for few tokens in two launches (see ROUTER_FUSED_MAX_TOKENS), else a GEMM
    and the routing launch."""
    return router_logits(x, weight, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid, bias=bias,
                         normalize=normalize, scale=scale, num_shared=num_shared).route()


def router_logits(x: torch.Tensor, weight: torch.Tensor, top_k: int, *, logits_dtype: torch.dtype, sigmoid: bool,
                  bias: torch.Tensor | None = None, normalize: bool = False, scale: float = 1.0,
                  num_shared: int = 0) -> RouterLogits:
    """route_hidden's first part: the router logits, as split-K partials for few tokens (one launch), else a
    GEMM; routed later (RouterLogits.route, or inside the fused experts' first GEMM)."""
    require(__name__)
    T, H = x.shape
    E = weight.shape[0]
    assert top_k <= E
    if T > ROUTER_FUSED_MAX_TOKENS or T == 0:
        logits = torch.nn.functional.linear(x.to(logits_dtype), weight.to(logits_dtype))
        return RouterLogits.of_logits(logits, top_k, sigmoid, bias, normalize, scale, num_shared)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    bk, be, splits, k_per_split = router_tiling(H, E)
    partial = torch.empty(splits, T, E, dtype=torch.float32, device=x.device)
    _router_partial_kernel[(T, cdiv(E, be), splits)](
        x, weight, partial, T, E, H, x.stride(0), weight.stride(0), k_per_split,
        BLOCK_E=be, BLOCK_K=bk, num_warps=4, **pdl_options(x.device))
    return partials_router(partial, T, E, top_k, logits_dtype=logits_dtype, sigmoid=sigmoid, bias=bias,
                           normalize=normalize, scale=scale, num_shared=num_shared)


def router_tiling(H: int, E: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_E, splits, k_per_split) of the split-K router launch over hidden size H."""
    k_blocks = cdiv(H, _ROUTER_BLOCK_K)
    k_per_split = cdiv(k_blocks, _ROUTER_SPLITS) * _ROUTER_BLOCK_K
    return _ROUTER_BLOCK_K, _ROUTER_BLOCK_E, cdiv(H, k_per_split), k_per_split


def partials_router(partial: torch.Tensor, T: int, E: int, top_k: int, *, logits_dtype: torch.dtype, sigmoid: bool,
                    bias: torch.Tensor | None, normalize: bool, scale: float, num_shared: int) -> RouterLogits:
    """The split-K partials [splits, T, E] of the router logits, to be routed."""
    return RouterLogits(partial, T, E, E, T * E, partial.shape[0], _ROUND[logits_dtype], top_k, sigmoid, bias,
                        normalize, scale, num_shared)
