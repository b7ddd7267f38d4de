"""Plain-torch reference of the Mamba2 mixer's stateful ops (conv and selective scan).

Two paths, as in the reference implementation the checkpoints were trained with:
- prefill (a request's prompt chunk, any length): depthwise causal conv over the chunk with the
  slot's conv history on the left, then the chunked SSD scan; dt is clamped to `dt_limit`.
- decode (one generated token): the conv window update and the one-step recurrence; dt is not
  clamped.
Both read the initial state from the request's slot (zero when `has_initial_state` is False) and
write the final state back to that slot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _read_slots(state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    rows = state[slots.clamp(min=0)]
    return torch.where(valid.view(-1, *([1] * (rows.dim() - 1))), rows, torch.zeros((), dtype=rows.dtype))


def _write_slots(state: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, value: torch.Tensor) -> None:
    if bool(valid.all()):
        state[slots] = value.to(state.dtype)
    else:
        state[slots[valid]] = value[valid].to(state.dtype)


def conv_decode(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, act=None) -> torch.Tensor:
    """One token per request. x [B, C]; conv_state [S, C, K-1]; weight [C, K]. Returns act(conv) [B, C]
    (`act` None: silu)."""
    valid = slots >= 0  # PAD_SLOT_ID rows read a zero history and write nothing
    history = _read_slots(conv_state, slots, valid)
    window = torch.cat([history.to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=-1)  # [B, C, K]
    _write_slots(conv_state, slots, valid, window[:, :, 1:])
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return (F.silu(out) if act is None else act(out)).to(x.dtype)


def conv_prefill(x: torch.Tensor, conv_state: torch.Tensor, slot: int, has_initial_state: bool,
                 weight: torch.Tensor, bias: torch.Tensor | None, act=None) -> torch.Tensor:
    """One request's chunk. x [L, C]. Returns act(conv) [L, C] (`act` None: silu) and stores the last
    K-1 inputs."""
    width = conv_state.shape[-1]
    if has_initial_state:
        history = conv_state[slot].to(weight.dtype)
    else:
        history = torch.zeros(x.shape[1], width, dtype=weight.dtype, device=x.device)
    window = torch.cat([history, x.t().to(weight.dtype)], dim=-1)  # [C, K-1 + L]
    conv_state[slot] = window[:, window.shape[1] - width:].to(conv_state.dtype)  # (width 0: conv_kernel 1)
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [C, L]
    return (F.silu(out) if act is None else act(out)).t().to(x.dtype)


def ssm_decode(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One-step recurrence. x [B, H, P]; dt [B, H]; B, C [B, G, N]; ssm_state [S, H, P, N]. Returns y [B, H, P]."""
    batch, heads, head_dim = x.shape
    groups = B.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))  # no clamp on the decode path
    dt = dt[:, :, None].expand(batch, heads, head_dim)
    dA = torch.exp(dt.float()[..., None] * A.float()[:, None, None])  # [B, H, P, 1]
    Bh = B.repeat_interleave(heads // groups, dim=1)[:, :, None, :]  # [B, H, 1, N]
    Ch = C.repeat_interleave(heads // groups, dim=1)  # [B, H, N]
    dBx = (dt[..., None] * Bh) * x[..., None]  # [B, H, P, N]
    valid = slots >= 0  # PAD_SLOT_ID rows read a zero state and write nothing
    state = _read_slots(ssm_state, slots, valid).float() * dA + dBx.float()
    _write_slots(ssm_state, slots, valid, state)
    y = torch.bmm(state.to(Ch.dtype).reshape(batch * heads, head_dim, -1),
                  Ch.reshape(batch * heads, -1, 1)).reshape(batch, heads, head_dim)
    return y + x * D.to(x.dtype)[:, None]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with out[i, j] = sum(a[j+1..i]) for j <= i, -inf above the diagonal."""
    length = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, length)
    strict_lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(expanded.masked_fill(~strict_lower, 0), dim=-2)
    lower = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=0)
    return sums.masked_fill(~lower, -torch.inf)


def ssm_prefill(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float], chunk_size: int,
                initial_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of one sequence. x [L, H, P]; dt [L, H]; B, C [L, G, N]; initial_state [H, P, N] or None.

    Returns (y [L, H, P] fp32, final_state [H, P, N] fp32).
    """
    length, heads, head_dim = x.shape
    groups = B.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [L, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    pad = (chunk_size - length % chunk_size) % chunk_size
    D_residual = D.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))  # [L+pad, H, P]
    x = x * dt[..., None]
    A_dt = A.float() * dt  # [L, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    x, A_dt, B, C = chunks(x), chunks(A_dt), chunks(B), chunks(C)  # [c, l, H, ...]
    A_dt = A_dt.permute(2, 0, 1)  # [H, c, l]
    A_cumsum = torch.cumsum(A_dt, dim=-1)

    # Intra-chunk (diagonal blocks): attention-like weights masked by the decay between positions.
    decay = torch.exp(_segment_sum(A_dt))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B)
    y_diag = torch.einsum("clsh,cshp->clhp", scores * decay.permute(1, 2, 3, 0), x)

    # State contributed by each chunk, as of the chunk's end.
    decay_to_end = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [H, c, l]
    chunk_states = torch.einsum("clhn,clhp->chpn", B * decay_to_end.permute(1, 2, 0)[..., None], x)

    # Inter-chunk recurrence: the state entering each chunk, and the final state.
    if initial_state is None:
        initial_state = torch.zeros(heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
    states = torch.cat([initial_state.float()[None], chunk_states], dim=0)  # [c+1, H, P, N]
    chunk_decay = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))  # [H, c+1, c+1]
    new_states = torch.einsum("hzc,chpn->zhpn", chunk_decay, states)
    entering, final_state = new_states[:-1], new_states[-1]

    # Contribution of the entering state to each position.
    y_off = torch.einsum("clhn,chpn->clhp", C, entering) * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, heads, head_dim) + D_residual
    return y[:length], final_state
