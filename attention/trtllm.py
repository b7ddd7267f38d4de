"""The trtllm attention backend (FlashInfer) over the paged KV cache, CUDA only.

KV layout (shared with attention/kv_cache.py, FlashInfer/trtllm "HND"):
    kv_layer: [num_pages, 2, num_kv_heads, page_size, head_dim]
- KV writes: one fused Triton launch writes K and V of every new token (rows with a negative
  location are skipped).
- decode-only steps: `flashinfer.decode.trtllm_batch_decode_with_kv_cache` (XQA on sm_90 and
  sm_120, trtllm-gen on sm_100; GPUs before sm_90 have neither: their decode and verify steps run
  our Triton paged kernel). It reads only device tensors (page table, seq lens) and a fixed
  max_seq_len (page-table width * page size), so it is CUDA-graph capturable.
- padded verify steps (every row K+1 tokens, `StepBatch.uniform_q_len`: the verify graphs'
  shape, graphs/padding.pad_verify_batch): the same decode kernel with q_len_per_req = K+1 and
  XQA's bit-packed causal mask over each request's new tokens; capturable too.
- prefill / mixed steps: on sm_100 `trtllm_batch_context_with_kv_cache`; elsewhere
  `BatchPrefillWithPagedKVCacheWrapper` (HND, causal bottom-right), planned once per step and
  reused by every attention layer. Head dims those have no kernel for (other than 64/128/256, e.g.
  Zamba2-2.7B's 160 and -7B's 224) run our Triton paged prefill kernel instead
  (attention/triton_prefill.py: no plan, its grid from T and B only; said once per head dim in the
  log), and so do decode and verify steps where the decode kernel does not build for the head dim
  (`decode_kernel_builds`: XQA takes unpadded power-of-two heads, trtllm-gen is assumed to take
  64/128/256 only); the Triton kernel splits the KV of such small launches itself.
  Non-16-bit model dtypes (and a cache dtype other than the model's or FP8) run the torch
  reference (attention/reference.py), every step.
- workspaces: each kernel family has its own (`Workspaces`). XQA keeps semaphores at the start of
  its workspace that must stay zero between calls, while FlashInfer's split-KV prefill writes
  partial outputs from offset 0 of its float workspace: sharing one buffer would let a prefill step
  that splits the KV (a short chunk over a long history) corrupt the next decode's semaphores.
- prefill plans under async scheduling: `plan()` stages its schedule in a pinned host buffer and
  copies it to the device asynchronously, so a wrapper must not be re-planned while a step that
  used it may still have that copy queued. Plans rotate through PLAN_RING wrappers (each with its
  own workspaces and pinned buffer), and re-planning one first waits on the event recorded after its
  previous plan: with at most one step in flight that wait is already over (`PrefillPlans`).
flashinfer is imported here only, and this module only on CUDA (triton here and in
attention/triton_prefill.py).
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from attention.reference import FP8_KV_DTYPE, TorchAttentionBackend
from attention.triton_prefill import paged_prefill_attention
from state_pool.util import cdiv

log = logging.getLogger(__name__)

_WORKSPACE_BYTES = 128 * 1024 * 1024
XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024  # flashinfer.decode.trtllm_batch_decode_with_kv_cache's split (0.6)
_PREFILL_HEAD_DIMS = (64, 128, 256)


def xqa_builds(head_dim: int) -> bool:
    """Whether sm_90's XQA decode kernel builds for this head dim. It pads a head to the next power of
    two and refuses (a static assertion at JIT time) a head that fills less than three quarters of
    it: 160 (Zamba2-2.7B) does not build. Only unpadded heads are taken, so 224 (Zamba2-7B), which
    may build but was never run, goes to our Triton kernel too."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def uses_trtllm_gen(sm: int) -> bool:
    """Whether FlashInfer's trtllm entry points run trtllm-gen on this major architecture: sm_100
    (B200/GB200) only. Its "auto" backend picks XQA on the others it supports (sm_90, sm_120)."""
    return sm == 10


def decode_kernel_builds(head_dim: int, sm: int) -> bool:
    """Whether FlashInfer's trtllm decode entry point has a kernel for this head dim on this major
    architecture: XQA on sm_90 / sm_120 (xqa_builds); trtllm-gen's prebuilt kernels on sm_100,
    assumed for the head dims FlashInfer's prefill has (64/128/256) only (no sm_100 at hand to try
    others); none on older GPUs (sm_80 / sm_86 / sm_89: XQA refuses them), whose decode and verify
    steps run our Triton paged kernel."""
    if uses_trtllm_gen(sm):
        return head_dim in _PREFILL_HEAD_DIMS
    return sm in (9, 12) and xqa_builds(head_dim)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, loc_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_page, stride_kv, stride_head, stride_off, page_size, k_mul, v_mul,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    loc = tl.load(loc_ptr + t)
    d = tl.arange(0, BLOCK)
    mask = (d < HEAD_DIM) & (loc >= 0)
    safe = tl.maximum(loc, 0)
    page = safe // page_size
    off = safe % page_size
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if QUANT:  # an FP8 cache stores x / scale, saturated at e4m3's largest finite value
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_mul, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_mul, -448.0), 448.0)
    base = kv_ptr + page * stride_page + h * stride_head + off * stride_off
    tl.store(base + d, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + stride_kv + d, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_fused(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_write_loc: torch.Tensor,
                   kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """K and V of T tokens ([T, kv_heads, head_dim]) into their pages, one launch (quantized with
    kv_scales into an FP8 cache, as attention/reference.py's quantize_kv)."""
    T, kvh, hd = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_layer.stride(-1) == 1
    _write_kv_kernel[(T, kvh)](
        k, v, kv_layer, kv_write_loc, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), kv_layer.shape[3],
        1.0 / kv_scales[0], 1.0 / kv_scales[1],
        HEAD_DIM=hd, BLOCK=triton.next_power_of_2(hd), QUANT=kv_layer.dtype == FP8_KV_DTYPE,
    )


PLAN_RING = 2  # prefill wrappers in rotation: the step being planned and the one in flight


class PrefillPlans:
    """FlashInfer paged-prefill wrappers in rotation, each re-planned only once the host-to-device
    copies of its previous plan have run (the event recorded right after that plan). All wrappers
    (and so their workspaces) are made up front, inside the memory plan's profiling forward."""

    def __init__(self, make_wrapper, ring: int = PLAN_RING, make_event=None) -> None:
        self._wrappers = [make_wrapper(i) for i in range(ring)]  # make_wrapper(i): with workspace i
        self._make_event = make_event or torch.cuda.Event
        self._events: list = [None] * ring
        self._next = 0
        self.current = None  # the wrapper planned last: every attention layer of the step runs it
        self.key = None  # (batch, shape key) of that plan

    def plan(self, key, plan_fn) -> None:
        """Plan the next wrapper of the ring with plan_fn(wrapper), after its previous plan's copies."""
        i = self._next
        self._next = (i + 1) % len(self._wrappers)
        if self._events[i] is not None:
            self._events[i].synchronize()  # returns at once unless that plan's copies are still queued
        plan_fn(self._wrappers[i])
        event = self._make_event()
        event.record()
        self._events[i] = event
        self.current, self.key = self._wrappers[i], key


def triton_decode_requested() -> bool:
    """HYBRID_DECODE_ATTENTION=triton: decode and verify steps on our Triton paged kernel (split KV) even where
    XQA builds. The A/B of `bench_moe.py --triton-decode-attention-ab`: in the MoE shapes' batch-1 kernel
    profiles XQA's span is ~20 us a layer for a 2K context (H200), where the KV is a few MB. Read at each
    call (a captured graph keeps what its capture read)."""
    return os.environ.get("HYBRID_DECODE_ATTENTION", "") == "triton"


class TrtllmAttentionBackend:
    name = "trtllm"
    supports_cuda_graphs = True  # for decode-only steps in 16-bit dtypes

    def __init__(self) -> None:
        import flashinfer  # noqa: F401 - fail early (ImportError) without the [gpu] extra

        self._workspaces: dict[str, torch.Tensor] = {}  # kernel family -> its own zeroed workspace
        self._plans: PrefillPlans | None = None
        self._reference = TorchAttentionBackend()
        self._sm = None
        self._logged_head_dims: set[tuple[int, str]] = set()  # (head dim, step kind) the Triton kernel runs
        self._masks: dict[tuple, torch.Tensor] = {}  # speculative verify masks by (rows, tokens, device)

    def graph_safe(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float16)

    def workspace(self, family: str, device: torch.device) -> torch.Tensor:
        """The workspace of one kernel family ("decode": XQA / trtllm-gen decode, "context": sm_100
        context, "prefill<i>": the i-th FlashInfer prefill wrapper), allocated zeroed on first use:
        the profiling forwards of the memory plan reach every family a step can use."""
        if family not in self._workspaces:
            self._workspaces[family] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[family]

    def must_stay_zero(self) -> list[tuple[str, torch.Tensor]]:
        """Workspace regions that must be zero between calls, for the state sanitizer: XQA's
        semaphores (the first XQA_SEMAPHORE_BYTES of the decode workspace; FlashInfer's decode entry
        point carves them there). A nonzero word after a step means a kernel left its multi-block
        bookkeeping dirty or another kernel wrote into it; the next decode could hang or read
        another request's partial results."""
        ws = self._workspaces.get("decode")
        return [] if ws is None else [("XQA semaphores", ws[:XQA_SEMAPHORE_BYTES].view(torch.int32))]

    def clear_regions(self) -> None:
        """Zero what must_stay_zero lists (after a sanitizer failure, so the engine keeps serving)."""
        for _, region in self.must_stay_zero():
            region.zero_()

    def forward(self, q, k, v, kv_layer, batch, scale, kv_scales: tuple[float, float] = (1.0, 1.0)):
        fp8_kv = kv_layer.dtype == FP8_KV_DTYPE  # a bf16/fp16 model over an FP8 cache: the kernels dequantize
        if not self.graph_safe(q.dtype) or (q.dtype != kv_layer.dtype and not fp8_kv):
            return self._reference.forward(q, k, v, kv_layer, batch, scale, kv_scales)
        num_tokens, num_heads, head_dim = q.shape
        if self._sm is None:
            self._sm = torch.cuda.get_device_capability(q.device)[0]
        write_kv_fused(kv_layer, k, v, batch.kv_write_loc, kv_scales)
        decode_step = batch.num_prefills == 0 and num_tokens == batch.num_decodes
        verify_step = batch.uniform_q_len > 1 and batch.num_verify == batch.num_requests
        if (decode_step or verify_step) and (not decode_kernel_builds(head_dim, self._sm) or triton_decode_requested()):
            # reads only device tensors and its grid depends on T and B alone: graph capturable as XQA is
            self._log_triton(head_dim, "decode")
            out = paged_prefill_attention(q, kv_layer, batch, scale, kv_scales)
        elif decode_step:
            out = self.decode(q, kv_layer, batch, scale, kv_scales)
        elif verify_step:
            out = self.verify(q, kv_layer, batch, scale, kv_scales)
        elif uses_trtllm_gen(self._sm) and head_dim in _PREFILL_HEAD_DIMS:
            out = self.context_sm100(q, kv_layer, batch, scale, kv_scales)
        elif head_dim in _PREFILL_HEAD_DIMS:
            out = self.prefill_sm90(q, kv_layer, batch, scale, kv_scales)
        else:  # e.g. Zamba2-2.7B / 7B (160 / 224): our Triton kernel over the pages (K/V are written already)
            self._log_triton(head_dim, "prefill")
            out = paged_prefill_attention(q, kv_layer, batch, scale, kv_scales)
        return out.reshape(num_tokens, num_heads * head_dim)

    def _log_triton(self, head_dim: int, kind: str) -> None:
        """Say once per (head dim, kind of step) that our Triton paged kernel runs it, and why."""
        if (head_dim, kind) in self._logged_head_dims:
            return
        self._logged_head_dims.add((head_dim, kind))
        if kind == "decode":
            why = "FlashInfer's decode kernel (XQA / trtllm-gen) does not build for it here"
            what = "decode and verify steps"
        else:
            why = "FlashInfer's prefill has no kernel for it"
            what = "prefill and mixed steps"
        log.info("attention head dim %d on sm_%d0: %s run the Triton paged kernel (attention/triton_prefill.py): %s",
                 head_dim, self._sm, what, why)

    def decode(self, q, kv_layer, batch, scale, kv_scales=(1.0, 1.0)):
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        page_size = kv_layer.shape[3]
        # the kernels' fused scales: softmax(q . k_stored * k_scale * scale) (v_stored * v_scale)
        return trtllm_batch_decode_with_kv_cache(
            query=q.contiguous(), kv_cache=kv_layer, workspace_buffer=self.workspace("decode", q.device),
            block_tables=batch.page_table, seq_lens=batch.seq_lens,
            max_seq_len=batch.page_table.shape[1] * page_size,
            bmm1_scale=float(scale) * kv_scales[0], bmm2_scale=float(kv_scales[1]), kv_layout="HND",
        )

    def verify(self, q, kv_layer, batch, scale, kv_scales=(1.0, 1.0)):
        """A padded verify step (every row batch.uniform_q_len tokens, graphs/padding.pad_verify_batch):
        the decode kernel in its speculative mode, q_len_per_req tokens a request under a causal mask
        over them (XQA; trtllm-gen on sm_100 applies the causal mask itself). Reads only device tensors
        and a fixed mask, so a verify step is CUDA-graph capturable like a decode step."""
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        page_size, n = kv_layer.shape[3], batch.uniform_q_len
        extra = {} if uses_trtllm_gen(self._sm) else {"mask": self._causal_mask(batch.num_requests, n, q.device)}
        return trtllm_batch_decode_with_kv_cache(
            query=q.contiguous(), kv_cache=kv_layer, workspace_buffer=self.workspace("decode", q.device),
            block_tables=batch.page_table, seq_lens=batch.seq_lens,
            max_seq_len=batch.page_table.shape[1] * page_size,
            bmm1_scale=float(scale) * kv_scales[0], bmm2_scale=float(kv_scales[1]), kv_layout="HND",
            q_len_per_req=n, **extra,
        )

    def _causal_mask(self, rows: int, n: int, device) -> torch.Tensor:
        """XQA's speculative-decoding mask [rows, n, words * 2] uint16, bit-packed in 32-bit words: query
        token i of a request sees its new tokens 0 .. i (everything before them is visible anyway).
        Cached per shape: a captured graph keeps reading the one it was captured with."""
        key = (rows, n, device)
        if key not in self._masks:
            words = (n + 31) // 32
            bits = torch.zeros(n, words, dtype=torch.int64)
            for i in range(n):
                for j in range(i + 1):
                    bits[i, j // 32] |= 1 << (j % 32)
            packed = bits.where(bits < 2**31, bits - 2**32).to(torch.int32)  # as signed 32-bit
            self._masks[key] = packed.view(torch.uint16).reshape(1, n, 2 * words).expand(rows, -1, -1) \
                .contiguous().to(device)
        return self._masks[key]

    def _paged_indices(self, batch, page_size: int, device):
        n_pages = [cdiv(s, page_size) for s in batch.seq_lens_cpu]
        kv_indptr = [0]
        for n in n_pages:
            kv_indptr.append(kv_indptr[-1] + n)
        rows = torch.repeat_interleave(torch.arange(len(n_pages)), torch.tensor(n_pages))
        cols = torch.cat([torch.arange(n) for n in n_pages])
        # non-blocking uploads: a blocking one would stall the host until the queued steps have run
        kv_indices = batch.page_table[_upload(rows, device), _upload(cols, device)].to(torch.int32).contiguous()
        last = [s - (n - 1) * page_size for s, n in zip(batch.seq_lens_cpu, n_pages)]
        return kv_indptr, kv_indices, last

    def prefill_sm90(self, q, kv_layer, batch, scale, kv_scales=(1.0, 1.0)):
        import flashinfer

        _, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv_layer.shape[2], kv_layer.shape[3]
        dev = q.device
        key = (num_heads, num_kv_heads, head_dim, page_size, float(scale), q.dtype, kv_layer.dtype)
        if self._plans is None:
            # an FP8 cache under bf16 queries: FlashInfer's FA2 kernels dequantize the pages (its "auto"
            # choice on sm_90, FA3, is for queries in FP8 too); the cache dtype is fixed for the process
            choice = {"backend": "fa2"} if kv_layer.dtype == FP8_KV_DTYPE else {}
            self._plans = PrefillPlans(lambda i: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace(f"prefill{i}", dev), kv_layout="HND", **choice))
        plans = self._plans
        if plans.key is None or plans.key[0] is not batch or plans.key[1] != key:
            qo_indptr = [0]
            for n in batch.query_lens_cpu:
                qo_indptr.append(qo_indptr[-1] + n)
            kv_indptr, kv_indices, last = self._paged_indices(batch, page_size, dev)
            # indptr and last-page lengths on the host, as plan() wants them: device ones are read back (a sync)
            i32 = dict(dtype=torch.int32)
            plans.plan((batch, key), lambda wrapper: wrapper.plan(
                torch.tensor(qo_indptr, **i32), torch.tensor(kv_indptr, **i32), kv_indices,
                torch.tensor(last, **i32), num_heads, num_kv_heads, head_dim, page_size,
                causal=True, sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=kv_layer.dtype,
            ))
        if kv_layer.dtype == FP8_KV_DTYPE:
            return plans.current.run(q.contiguous(), kv_layer, k_scale=float(kv_scales[0]),
                                     v_scale=float(kv_scales[1]))
        return plans.current.run(q.contiguous(), kv_layer)

    def context_sm100(self, q, kv_layer, batch, scale, kv_scales=(1.0, 1.0)):
        from flashinfer.prefill import trtllm_batch_context_with_kv_cache

        cum_kv = [0]
        for s in batch.seq_lens_cpu:
            cum_kv.append(cum_kv[-1] + s)
        return trtllm_batch_context_with_kv_cache(
            query=q.contiguous(), kv_cache=kv_layer, workspace_buffer=self.workspace("context", q.device),
            block_tables=batch.page_table,
            seq_lens=batch.seq_lens, max_q_len=max(batch.query_lens_cpu), max_kv_len=max(batch.seq_lens_cpu),
            bmm1_scale=float(scale) * kv_scales[0], bmm2_scale=float(kv_scales[1]), batch_size=batch.num_requests,
            cum_seq_lens_q=batch.query_start_loc,
            cum_seq_lens_kv=_upload(torch.tensor(cum_kv, dtype=torch.int32), q.device), kv_layout="HND",
        )


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there (pinned, non-blocking)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
