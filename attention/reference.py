"""The plain-torch attention backend over the paged KV cache: the CPU reference (and the fallback
of the trtllm backend for shapes and dtypes it has no kernel for)."""
from __future__ import annotations

import torch

from state_pool.util import cdiv


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite e4m3 value: quantized K/V saturate there


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x in the cache's dtype: as is for a 16/32-bit cache; x / scale, saturated, in e4m3 for an FP8 one.
    The division is a multiplication by the fp32 reciprocal, as the CUDA write kernel does it, so
    both round every value to the same e4m3 byte."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_write_loc: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Scatter the new tokens' K and V into their pages (quantized with kv_scales in an FP8 cache)."""
    page_size = kv_layer.shape[3]
    page = kv_write_loc // page_size
    offset = kv_write_loc % page_size
    kv_layer[page, 0, :, offset, :] = quantize_kv(k, kv_layer.dtype, kv_scales[0])
    kv_layer[page, 1, :, offset, :] = quantize_kv(v, kv_layer.dtype, kv_scales[1])


def gather_kv(kv_layer: torch.Tensor, pages: torch.Tensor, seq_len: int,
              kv_scales: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K and V as [num_kv_heads, seq_len, head_dim] (an FP8 cache's dequantized, in fp32)."""
    blocks = kv_layer[pages]  # [n, 2, kvh, page_size, hd]
    n, _, kvh, ps, hd = blocks.shape
    k = blocks[:, 0].permute(1, 0, 2, 3).reshape(kvh, n * ps, hd)[:, :seq_len]
    v = blocks[:, 1].permute(1, 0, 2, 3).reshape(kvh, n * ps, hd)[:, :seq_len]
    if kv_layer.dtype == FP8_KV_DTYPE:
        return k.float() * kv_scales[0], v.float() * kv_scales[1]
    return k, v


class TorchAttentionBackend:
    """Plain-torch reference: loops over requests, softmax in fp32 like eager attention."""

    name = "torch"

    def must_stay_zero(self) -> list[tuple[str, torch.Tensor]]:
        return []  # no persistent workspace

    def clear_regions(self) -> None:
        pass

    def forward(self, q, k, v, kv_layer, batch, scale, kv_scales: tuple[float, float] = (1.0, 1.0)):
        write_kv(kv_layer, k, v, batch.kv_write_loc, kv_scales)
        return self.attend(q, kv_layer, batch, scale, kv_scales)

    def attend(self, q, kv_layer, batch, scale, kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """Attention of the new queries over the cache, whose pages already hold this step's K/V."""
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        page_size = kv_layer.shape[3]
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens_cpu, batch.seq_lens_cpu)):
            end = start + q_len
            n_pages = cdiv(seq_len, page_size)
            keys, values = gather_kv(kv_layer, batch.page_table[i, :n_pages].long(), seq_len, kv_scales)
            group = num_heads // keys.shape[0]
            keys = keys.repeat_interleave(group, dim=0).to(q.dtype)
            values = values.repeat_interleave(group, dim=0).to(q.dtype)
            qi = q[start:end].transpose(0, 1)  # [heads, q_len, hd]
            scores = torch.matmul(qi, keys.transpose(1, 2)) * scale
            # query j sits at absolute position seq_len - q_len + j and sees keys up to it
            context = seq_len - q_len
            qpos = torch.arange(q_len, device=q.device)[:, None] + context
            kpos = torch.arange(seq_len, device=q.device)[None, :]
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = torch.matmul(probs, values).transpose(0, 1)
            start = end
        return out.reshape(num_tokens, num_heads * head_dim)
