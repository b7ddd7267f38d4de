"""GPU memory planning, like vLLM's gpu_memory_utilization.

After the weights are loaded, one profiling forward runs at the largest prefill chunk
(max_num_batched_tokens tokens) and one at the largest decode batch (max_num_seqs rows) against a
throw-away one-slot pool and a few KV pages. Then

    budget = total * gpu_memory_utilization - (memory in use now) - activation peak - graph reserve

is split (split_budget, pure arithmetic): first max_num_seqs Mamba state slots (+ the cached
prefixes' slots and the scratch row), then, with speculation, the verify scratch (max_num_seqs x
(K+1) more states, MambaStatePool.enable_spec_scratch), then KV pages (at most what max_num_seqs
sequences of max_model_len need). Too little memory is a CapacityError at startup.

MoE models: every expert's weights are resident (counted in the weights, and named in the summary);
the fused MoE path's routing workspace (pair order, block table, the per-pair intermediates) is
sized by the step's token count alone, never by the routing, so the profiling forwards at the
largest chunk and the largest decode batch cover it.

The graph reserve (graph_reserve_bytes) is a fixed 512 MiB plus the captured graphs' outputs:
graphs/runner.py captures every bucket (the small ones once per context bucket) into one shared
pool and keeps each graph's fp32 logits [bucket, vocab] alive there, so those add up over the
graphs (the intermediates are reused). With piecewise graphs (graphs/piecewise.py) the reserve also
holds the intermediates of a step of their largest token bucket: the activation peak's share at that
many tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from attention.kv_cache import PagedKVCache
from graphs.padding import (
    CONTEXT_BUCKET_MAX_BATCH, VERIFY_GRAPH_MAX_ROWS, context_widths, default_capture_sizes, padding_batch,
    verify_graph_sizes, verify_graphs_requested,
)
from state_pool.errors import CapacityError
from state_pool.pool import MambaStatePool, StateShapes
from state_pool.step_batch import StepBatch
from state_pool.util import cdiv

logger = logging.getLogger("hybrid")

GiB = float(2**30)
GRAPH_RESERVE_BYTES = 512 * 2**20


@dataclass
class MemoryPlan:
    num_slots: int
    num_kv_pages: int
    budget_bytes: int
    slot_bytes: int
    page_bytes: int
    activation_bytes: int
    weight_bytes: int
    max_tokens: int  # KV tokens that fit (all requests together)
    spec_scratch_bytes: int = 0  # speculative verify scratch: max_num_seqs x (K+1) Mamba states
    graph_reserve_bytes: int = 0  # CUDA graphs: fixed reserve + every bucket's logits output
    expert_bytes: int = 0  # of weight_bytes: the routed experts (MoE models), all resident

    def summary(self, max_num_seqs: int, max_model_len: int, page_size: int) -> str:
        full = self.max_tokens // max_model_len if self.page_bytes else max_num_seqs
        experts = f" (routed experts {self.expert_bytes / GiB:.2f} GiB)" if self.expert_bytes else ""
        return (f"memory plan: weights {self.weight_bytes / GiB:.2f} GiB{experts}, activation peak "
                f"{self.activation_bytes / GiB:.2f} GiB, CUDA graphs {self.graph_reserve_bytes / GiB:.2f} GiB, "
                f"budget {self.budget_bytes / GiB:.2f} GiB; "
                f"Mamba state {self.num_slots} slots x {self.slot_bytes / 2**20:.1f} MiB = "
                f"{self.num_slots * self.slot_bytes / GiB:.2f} GiB; speculative verify scratch "
                f"{self.spec_scratch_bytes / GiB:.2f} GiB; KV cache {self.num_kv_pages - 1} pages x "
                f"{page_size} tokens = {self.max_tokens} tokens ({self.num_kv_pages * self.page_bytes / GiB:.2f} GiB); "
                f"fits {max_num_seqs} concurrent requests, {min(full, max_num_seqs)} of them at the full "
                f"max_model_len={max_model_len}")


def graph_reserve_bytes(capture_sizes: list[int], vocab_size: int, verify_q_len: int = 0,
                        max_num_seqs: int | None = None, context_buckets: int = 1) -> int:
    """Memory the captured CUDA graphs keep: GRAPH_RESERVE_BYTES plus, for every graph, its fp32
    logits output [bucket, vocab], which stays alive in the shared graph pool (a sum, not a max:
    each graph's output tensor is kept, so no later capture can reuse it): one graph a bucket, and
    `context_buckets` for buckets of at most CONTEXT_BUCKET_MAX_BATCH rows (graphs/runner.py); with
    verify graphs (verify_q_len = K+1) also theirs, [bucket x (K+1), vocab] each."""
    verify = verify_graph_sizes(capture_sizes, max_num_seqs if max_num_seqs is not None else VERIFY_GRAPH_MAX_ROWS)
    verify_rows = sum(verify) * verify_q_len
    narrow_rows = sum(s for s in capture_sizes if s <= CONTEXT_BUCKET_MAX_BATCH) * (context_buckets - 1)
    return GRAPH_RESERVE_BYTES + (sum(capture_sizes) + narrow_rows + verify_rows) * vocab_size * 4



def capture_sizes(cuda_graph_sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The buckets ModelRunner captures for these arguments (as graphs/runner.py derives them)."""
    sizes = cuda_graph_sizes if cuda_graph_sizes else default_capture_sizes(max_num_seqs)
    return sorted({int(s) for s in sizes if int(s) >= 1})


def spec_scratch_bytes(slot_bytes: int, max_num_seqs: int, num_speculative_tokens: int) -> int:
    """Bytes of the verify scratch the engine allocates with speculation (enable_spec_scratch):
    the state after each of the K+1 tokens of every one of max_num_seqs verify rows."""
    return max_num_seqs * (num_speculative_tokens + 1) * slot_bytes if num_speculative_tokens else 0


def split_budget(budget: int, *, slot_bytes: int, page_bytes: int, page_size: int, max_num_seqs: int,
                 max_model_len: int, extra_state_slots: int = 0, num_speculative_tokens: int = 0,
                 num_kv_pages: int | None = None, accounting: str = "") -> tuple[int, int, int]:
    """Split `budget` bytes (what is left for state and KV cache) into the Mamba slots, the
    speculative verify scratch and KV pages, in that order. Returns (state_bytes, spec_scratch_bytes,
    num_kv_pages). CapacityError, naming what does not fit, when the slots, the scratch and one
    max_model_len sequence of KV do not all fit, or when a given num_kv_pages does not.
    `accounting` is appended to the messages (where the budget came from)."""
    pages_per_seq = cdiv(max_model_len, page_size)
    # one slot per sequence, the extra ones (cached prefixes) and the scratch row
    state_bytes = (max_num_seqs + extra_state_slots + 1) * slot_bytes
    spec_bytes = spec_scratch_bytes(slot_bytes, max_num_seqs, num_speculative_tokens)
    min_kv = (pages_per_seq + 1) * page_bytes if page_bytes else 0
    if budget < state_bytes + spec_bytes + min_kv:
        per_seq = slot_bytes * (1 + (num_speculative_tokens + 1 if num_speculative_tokens else 0))
        fit = max(0, (budget - min_kv - (extra_state_slots + 1) * slot_bytes) // per_seq) if per_seq else 0
        spec = (f", the speculative verify scratch (num_speculative_tokens={num_speculative_tokens}: "
                f"{max_num_seqs} x {num_speculative_tokens + 1} Mamba states) needs {spec_bytes / GiB:.2f} GiB"
                if spec_bytes else "")
        raise CapacityError(
            f"max_num_seqs={max_num_seqs} and max_model_len={max_model_len} do not fit: "
            f"{budget / GiB:.2f} GiB are left for state and KV cache{accounting}; "
            f"{max_num_seqs + extra_state_slots + 1} Mamba slots need {state_bytes / GiB:.2f} GiB "
            f"({slot_bytes / 2**20:.1f} MiB each){spec}"
            + (f" and one max_model_len sequence needs {min_kv / GiB:.2f} GiB of KV" if min_kv else "")
            + f"; at most {fit} sequences fit with these settings")
    kv_budget = budget - state_bytes - spec_bytes
    if num_kv_pages is None:
        cap = max_num_seqs * pages_per_seq + 1
        num_kv_pages = min(cap, kv_budget // page_bytes) if page_bytes else cap
    elif page_bytes and num_kv_pages * page_bytes > kv_budget:
        raise CapacityError(
            f"num_kv_pages={num_kv_pages} needs {num_kv_pages * page_bytes / GiB:.2f} GiB but only "
            f"{kv_budget / GiB:.2f} GiB are left after {max_num_seqs + extra_state_slots + 1} Mamba slots"
            + (" and the speculative verify scratch" if spec_bytes else ""))
    return state_bytes, spec_bytes, int(num_kv_pages)


def _profile_batch(num_tokens: int, num_decodes: int, page_size: int, device) -> StepBatch:
    """One prefill request of num_tokens (slot 0, pages 1..) or num_decodes padding decode rows."""
    dev = device
    if num_decodes:
        return padding_batch(num_decodes, page_size, device)
    pages = cdiv(num_tokens, page_size)
    return StepBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=dev),
        positions=torch.arange(num_tokens, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        page_table=torch.arange(1, pages + 1, dtype=torch.int32, device=dev)[None],
        kv_write_loc=torch.arange(num_tokens, dtype=torch.long, device=dev) + page_size,
        state_slot=torch.zeros(1, dtype=torch.long, device=dev),
        has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev),
        logits_indices=torch.tensor([num_tokens - 1], dtype=torch.long, device=dev), num_decodes=0, num_prefills=1,
        query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], state_slot_cpu=[0], has_initial_state_cpu=[False],
    )


def plan_memory(model, cfg, *, device: torch.device, gpu_memory_utilization: float, max_num_seqs: int,
                max_model_len: int, max_num_batched_tokens: int, page_size: int, kv_dtype: torch.dtype,
                conv_dtype: torch.dtype, ssm_dtype: torch.dtype, attention_backend, num_kv_pages: int | None,
                use_graphs: bool, extra_state_slots: int = 0, num_speculative_tokens: int = 0,
                cuda_graph_sizes: list[int] | None = None, piecewise_max_tokens: int = 0,
                full_graphs: bool = True) -> MemoryPlan:
    from hybrid.model import ForwardContext
    from hybrid.moe import Experts

    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    m, a = cfg.mamba, cfg.attention
    n_mamba, n_attn = len(cfg.mamba_layers), len(cfg.attention_layers)
    shapes = StateShapes(n_mamba, m.conv_dim, m.conv_kernel - 1, m.num_heads, m.head_dim, m.state_size) if m else None
    slot_bytes = shapes.bytes_per_slot(conv_dtype, ssm_dtype) if shapes and n_mamba else 0
    page_bytes = PagedKVCache.bytes_per_page(n_attn, page_size, a.num_kv_heads, a.head_dim, kv_dtype) if n_attn else 0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    expert_bytes = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, Experts)
                       for p in m.parameters())

    free0, total0 = torch.cuda.mem_get_info(device)
    # before profiling: state alone (with the verify scratch) beyond the whole budget cannot fit
    split_budget(int(total0 * gpu_memory_utilization), slot_bytes=slot_bytes, page_bytes=0, page_size=page_size,
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len, extra_state_slots=extra_state_slots,
                 num_speculative_tokens=num_speculative_tokens,
                 accounting=f" even before weights and activations (the whole budget at gpu_memory_utilization="
                            f"{gpu_memory_utilization})")

    # ---- profiling forward at the largest chunk and the largest decode batch
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    chunk = max(1, min(max_num_batched_tokens, max_model_len))
    pool = MambaStatePool(shapes, 1, device, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype) if shapes else None
    kv = PagedKVCache(n_attn, cdiv(chunk, page_size) + 1, page_size, a.num_kv_heads if a else 1,
                      a.head_dim if a else 1, device, kv_dtype)
    ctx = ForwardContext(pool, kv, attention_backend)
    scratch_bytes = torch.cuda.memory_allocated(device) - base
    model(_profile_batch(chunk, 0, page_size, device), ctx)
    model(_profile_batch(0, min(max_num_seqs, max_num_batched_tokens), page_size, device), ctx)
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - base - scratch_bytes
    del pool, kv, ctx
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    verify_q_len = num_speculative_tokens + 1 if verify_graphs_requested(num_speculative_tokens, model) else 0
    reserve = (graph_reserve_bytes(capture_sizes(cuda_graph_sizes, max_num_seqs), cfg.vocab_size, verify_q_len,
                                   max_num_seqs, len(context_widths(cdiv(max_model_len, page_size), page_size)))
               if use_graphs and full_graphs else 0)
    if use_graphs and piecewise_max_tokens:
        # the piecewise graphs' intermediates (graphs/piecewise.py): a step of their largest bucket, in the same
        # pool; activations grow with the tokens, so that is the profiled peak's share at that many tokens
        reserve += int(activation * min(1.0, piecewise_max_tokens / chunk))
    budget = int(total * gpu_memory_utilization) - in_use - activation - reserve
    _, spec_bytes, num_kv_pages = split_budget(
        budget, slot_bytes=slot_bytes, page_bytes=page_bytes, page_size=page_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, extra_state_slots=extra_state_slots,
        num_speculative_tokens=num_speculative_tokens, num_kv_pages=num_kv_pages,
        accounting=f" at gpu_memory_utilization={gpu_memory_utilization} (total {total / GiB:.1f} GiB, in use "
                   f"{in_use / GiB:.2f} GiB, activations {activation / GiB:.2f} GiB, CUDA graphs "
                   f"{reserve / GiB:.2f} GiB)")
    return MemoryPlan(num_slots=max_num_seqs + extra_state_slots, num_kv_pages=int(num_kv_pages), budget_bytes=int(budget),
                      slot_bytes=slot_bytes, page_bytes=page_bytes, activation_bytes=int(activation),
                      weight_bytes=weight_bytes, max_tokens=(int(num_kv_pages) - 1) * page_size,
                      spec_scratch_bytes=spec_bytes, graph_reserve_bytes=reserve, expert_bytes=expert_bytes)
