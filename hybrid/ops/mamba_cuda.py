"""CUDA dispatch of the Mamba2 mixer's stateful ops (installed as `Mamba2Mixer.kernels`).

- decode rows, `decode_kernels="triton"` (default): our own Triton kernels
  (hybrid/ops/triton_mamba.py: one CTA per (head-dim block, head, request), the whole state dim
  in registers; they skip PAD_SLOT_ID rows themselves). `decode_kernels="library"`: causal-conv1d's
  `causal_conv1d_update` (conv_state_indices) and mamba-ssm's Triton `selective_state_update` with
  state indices. mamba-ssm's kernel cannot skip padding, and causal-conv1d skips negative indices
  only in some versions, so neither is given PAD_SLOT_ID: padding rows are pointed at the pool's
  scratch row (the last row, which no request owns) for both, and padding never reads or writes a
  live slot whatever the library version does. Both are CUDA-graph safe.
- replay rows (a readmitted sequence's known generated tokens, see hybrid/batch.py): the decode
  kernels again, in place on the row's slot: `triton_replay` (T-token launches grouped by T), or
  with the library kernels one token position per call.
- decode, verify and replay on our kernels all go through `triton_recurrence`, i.e. the same two
  kernels under one state contract: the state is rounded to its storage dtype after every token,
  so a T-token verify or replay launch commits bit for bit what T decode steps would
  (tests/test_state_contract.py).
- prefill chunks: a step of two or more prefill rows, or a row with prefix-cache snapshots, runs them
  together (the "varlen_prefill" switch, on unless HYBRID_VARLEN_PREFILL=0): one varlen conv launch, one
  zero-state varlen scan (mamba-ssm's resets to zero at sequence boundaries) and one launch that adds each
  row's initial state to its outputs and writes its final state and its snapshots' states
  (hybrid/ops/triton_mamba_varlen.py). A single plain row, or the library decode kernels, run one request
  at a time (with the library kernels, a row with snapshots as one segment a snapshot): the causal conv
  runs over [slot history | chunk], on our token-major Triton kernel (`triton_mamba.conv_prefill`; with the
  library decode kernels, causal-conv1d's `causal_conv1d_fn`, which wants channel-first input: two
  transposes that cost ~1.7 ms per layer on an 8K chunk); mamba-ssm's chunked scan (`mamba_chunk_scan_combined`'s
  kernels and configs, issued with little host work: hybrid/ops/mamba_scan.py) runs with the slot's SSM
  state as initial state (or none for a first chunk) and its final state is written back.

Semantics match hybrid/ops/mamba_torch.py (dt clamped to dt_limit on prefill only).
mamba-ssm and causal-conv1d are optional: nothing here is imported on CPU.
"""
from __future__ import annotations

import functools
import math

import torch

from hybrid.config import GATE_THEN_NORM
from hybrid.layers import Linear
from hybrid.mamba_metadata import step_metadata
from hybrid.ops import triton_gemv
from hybrid.ops import triton_mamba_varlen as tv
from hybrid.ops.triton_guard import switch
from hybrid.step_cores import run_core

_LOADED = None


def load_kernels():
    """(chunk_scan, state_update, conv_fn, conv_update); raises ImportError without the [gpu] extra."""
    global _LOADED
    if _LOADED is None:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update

        from hybrid.ops.mamba_ssm_shim import mamba_ssm_triton

        from hybrid.ops.mamba_scan import ChunkScan

        _, state_update = mamba_ssm_triton()  # registers the bare mamba_ssm package ChunkScan imports from
        _LOADED = (ChunkScan(), state_update, causal_conv1d_fn, causal_conv1d_update)
    return _LOADED


def kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        load_kernels()
    except Exception:  # noqa: BLE001 - any import problem means "use the torch path"
        return False
    return True


class MambaCudaKernels:

    def __init__(self, decode_kernels: str = "triton") -> None:
        if decode_kernels not in ("triton", "library"):
            raise ValueError(f"decode_kernels must be 'triton' or 'library', got {decode_kernels!r}")
        self.chunk_scan, self.state_update, self.conv_fn, self.conv_update = load_kernels()
        self.decode_kernels = decode_kernels
        # Speculative verify rows (per-token states into the verify scratch) run on our Triton kernels;
        # with the library decode kernels they take the mixer's torch path.
        self.supports_verify = decode_kernels == "triton"
        if decode_kernels == "triton":
            from hybrid.ops import triton_mamba

            self.triton = triton_mamba
        self._params: dict[int, dict[str, torch.Tensor]] = {}

    def params(self, mixer) -> dict[str, torch.Tensor]:
        """fp32 A, D, dt_bias (and the broadcast views selective_state_update wants), cached per mixer."""
        p = self._params.get(id(mixer))
        if p is None:
            cfg = mixer.cfg
            nh, P, N = cfg.num_heads, cfg.head_dim, cfg.state_size
            A = (-torch.exp(mixer.A_log.float())).contiguous()
            D = mixer.D.float().contiguous()
            dt_bias = mixer.dt_bias.float().contiguous()
            p = {
                "A": A, "D": D, "dt_bias": dt_bias,
                "A_hpn": A[:, None, None].expand(nh, P, N),
                "D_hp": D[:, None].expand(nh, P),
                "dt_bias_hp": dt_bias[:, None].expand(nh, P),
            }
            self._params[id(mixer)] = p
        return p

    def mamba_forward(self, mixer, hidden: torch.Tensor, batch, conv_state: torch.Tensor,
                      ssm_state: torch.Tensor) -> torch.Tensor:
        cfg = mixer.cfg
        inner, conv_dim, nh, P = cfg.intermediate_size, cfg.conv_dim, cfg.num_heads, cfg.head_dim
        p = self.params(mixer)
        T = hidden.shape[0]
        if self.decode_kernels == "triton" and batch.num_decodes == T:  # a decode-only step (graphs replay these)
            fuse_conv, fuse_out = self._decode_fusions(mixer, hidden)
            if fuse_conv or fuse_out:
                return self._fused_decode(mixer, p, hidden, batch.state_slot[:T], conv_state, ssm_state,
                                          fuse_conv, fuse_out)
        zxbcdt = mixer.in_proj(hidden)
        z, xBC, dt = torch.split(zxbcdt, [inner, conv_dim, nh], dim=-1)
        core = functools.partial(self._mix, mixer, p, conv_state=conv_state, ssm_state=ssm_state, dtype=hidden.dtype)
        y = run_core(core, batch, (xBC, dt), (nh, P), hidden.dtype)
        return mixer.project_out(y.reshape(T, inner), z, hidden.dtype)

    def _mix(self, mixer, p: dict[str, torch.Tensor], batch, xBC: torch.Tensor, dt: torch.Tensor, *,
             conv_state: torch.Tensor, ssm_state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer's core (hybrid/step_cores.py): conv and scan of every row kind, the slots' state writes.
        Returns y [T, heads, head_dim] in `dtype` (the layer's input's)."""
        cfg = mixer.cfg
        nh, P = cfg.num_heads, cfg.head_dim
        T = xBC.shape[0]
        y = torch.empty(T, nh, P, dtype=dtype, device=xBC.device)
        scratch = conv_state.shape[0] - 1

        nd = batch.num_decodes
        if nd and self.decode_kernels == "triton":
            triton_recurrence(self.triton, mixer, p, xBC[:nd], dt[:nd], conv_state, ssm_state,
                              batch.state_slot[:nd], out=y[:nd])
        elif nd:
            slots = batch.state_slot[:nd]
            # padding rows (PAD_SLOT_ID) go to the scratch row for both library kernels: mamba-ssm's
            # cannot skip negative indices, and causal-conv1d's skipping depends on its version
            y[:nd] = self._library_step(mixer, p, xBC[:nd], dt[:nd], conv_state, ssm_state,
                                        slots.masked_fill(slots < 0, scratch))

        nv = batch.num_verify
        if nv:
            triton_verify(self.triton, mixer, xBC, dt, p, y, batch, conv_state, ssm_state)
        nr = batch.num_replay
        if nr and self.decode_kernels == "triton":
            triton_replay(self.triton, mixer, xBC, dt, p, y, batch, conv_state, ssm_state)
        elif nr:
            self._library_replay(mixer, xBC, dt, p, y, batch, conv_state, ssm_state)

        meta = step_metadata(batch)  # built once per step, shared by every layer
        prefills = meta.prefills
        if meta.varlen is not None and self.decode_kernels == "triton":  # every prefill row in one launch each
            first, end = prefills[0].start, prefills[-1].start + prefills[-1].length
            out_y = self._prefill_varlen(mixer, p, xBC[first:end], dt[first:end], conv_state, ssm_state, meta.varlen)
            if out_y is not None:
                if end - first == T and out_y.dtype == y.dtype:
                    y = out_y
                else:
                    y[first:end] = out_y.to(y.dtype)
                prefills = ()
        for row in prefills:
            length, slot, has_init = row.length, row.slot, row.has_initial_state
            rows = slice(row.start, row.start + length)
            if slot < 0:  # padding row: touches no state
                y[rows].zero_()
                continue
            out_y = self._prefill_row(mixer, p, xBC[rows], dt[rows], conv_state, ssm_state, slot, has_init)
            if length == T and out_y.dtype == y.dtype:
                y = out_y  # the step is this one chunk: the scan's output is y (no copy of T x inner)
            else:
                y[rows] = out_y.to(y.dtype)
            row.keep_snapshot(conv_state, ssm_state)  # a prefix-cache snapshot: the state after this segment
        return y

    def _decode_fusions(self, mixer, hidden: torch.Tensor) -> tuple[bool, bool]:
        """For a decode-only step: (in_proj and conv in one launch: the "decode_in_proj_conv" switch, the
        gated norm's sums of squares in the SSM update and the norm inside out_proj: "decode_gated_out_proj"),
        each where its projection is a 16-bit one the fused ops own, at a decode size (in_proj and conv: an
        in_proj of at most triton_gemv.IN_PROJ_CONV_MAX_BYTES, past which cuBLAS streams it faster)."""
        cfg, proj_in, proj_out = mixer.cfg, mixer.in_proj, mixer.out_proj
        fuse_conv = (switch("decode_in_proj_conv") and type(proj_in) is Linear and proj_in.fused
                     and triton_gemv.eligible(hidden, proj_in.weight)
                     and hidden.shape[0] <= triton_gemv.in_proj_conv_max_rows()
                     and (proj_in.weight.numel() * proj_in.weight.element_size() <= triton_gemv.IN_PROJ_CONV_MAX_BYTES
                          or triton_gemv.preload_everywhere(hidden.shape[0])))
        # (exactly Linear: tensor parallelism's RowParallelLinear all-reduces in its forward, which this skips)
        fuse_out = (switch("decode_gated_out_proj") and type(proj_out) is Linear and proj_out.fused and mixer.fused
                    and cfg.gate == GATE_THEN_NORM and mixer.norm_stats is None
                    and triton_gemv.eligible(hidden, proj_out.weight)
                    and mixer.norm_weight.dtype == hidden.dtype
                    and triton_gemv.gated_norm_block_k(cfg.intermediate_size // cfg.n_groups) is not None)
        return fuse_conv, fuse_out

    def _fused_decode(self, mixer, p: dict[str, torch.Tensor], hidden: torch.Tensor, slots: torch.Tensor,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, fuse_conv: bool,
                      fuse_out: bool) -> torch.Tensor:
        """A decode-only step of one Mamba layer with fewer launches: in_proj + conv as one
        (triton_gemv.in_proj_conv) and/or the gated norm folded into the SSM update and out_proj
        (selective_state_update_gated, triton_gemv.gated_out_proj); the same math as the other path."""
        cfg = mixer.cfg
        inner, conv_dim, nh = cfg.intermediate_size, cfg.conv_dim, cfg.num_heads
        T = hidden.shape[0]
        if fuse_conv:
            zxbcdt = triton_gemv.in_proj_conv(hidden, mixer.in_proj.weight, mixer.in_proj.bias, conv_state,
                                              mixer.conv_weight, mixer.conv_bias, slots, inner)
            z, xbc, dt = torch.split(zxbcdt, [inner, conv_dim, nh], dim=-1)
        else:
            z, xBC, dt = torch.split(mixer.in_proj(hidden), [inner, conv_dim, nh], dim=-1)
            xbc = self.triton.conv_state_update(xBC, conv_state, mixer.conv_weight, mixer.conv_bias, slots)
        if not fuse_out:
            y = triton_ssm_step(self.triton, mixer, p, xbc, dt, ssm_state, slots)
            return mixer.project_out(y.reshape(T, inner), z, hidden.dtype)
        x, B, C = ssm_operands(cfg, xbc)
        y, sq = self.triton.selective_state_update_gated(ssm_state, x, dt, p["A"], B, C, p["D"], p["dt_bias"], slots,
                                                         z.reshape(x.shape))
        proj = mixer.out_proj
        return triton_gemv.gated_out_proj(y.reshape(T, inner), z, mixer.norm_weight, cfg.norm_eps, cfg.n_groups, sq,
                                          proj.weight, proj.bias)

    def _prefill_row(self, mixer, p: dict[str, torch.Tensor], xBC: torch.Tensor, dt: torch.Tensor,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, slot: int, has_init: bool) -> torch.Tensor:
        """One request's prefill chunk (xBC, dt: its rows of the in_proj output): the causal conv over
        [slot history | chunk], then the chunked scan from the slot's state (or zero); the slot's conv
        and SSM state become the chunk's last. Returns y [length, heads, head_dim]."""
        cfg = mixer.cfg
        inner, nh, P, G, N = cfg.intermediate_size, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        length = xBC.shape[0]
        if self.decode_kernels == "triton":
            # token-major causal conv over [slot history | chunk]: our Triton kernel, no transposes
            xbc = self.triton.conv_prefill(xBC, conv_state, slot, has_init, mixer.conv_weight, mixer.conv_bias)
        else:
            xbc = self._library_conv_prefill(mixer, xBC, conv_state, slot, has_init)
        x, B, C = torch.split(xbc, [inner, G * N, G * N], dim=-1)
        init = ssm_state[slot][None].float() if has_init else None
        # strided views: the scan copies only what its kernels need contiguous
        out_y, final = self.chunk_scan(  # mamba_chunk_scan_combined with little host work (hybrid/ops/mamba_scan.py)
            x.reshape(1, length, nh, P), dt[None], p["A"],
            B.reshape(1, length, G, N), C.reshape(1, length, G, N),
            cfg.chunk_size, p["D"], p["dt_bias"], init, tuple(cfg.dt_limit),
        )
        ssm_state[slot] = final[0].to(ssm_state.dtype)
        return out_y[0]

    def _prefill_varlen(self, mixer, p: dict[str, torch.Tensor], xBC: torch.Tensor, dt: torch.Tensor,
                        conv_state: torch.Tensor, ssm_state: torch.Tensor, rows) -> torch.Tensor | None:
        """All of a step's prefill rows (xBC, dt: their rows of the in_proj output, back to back): the varlen
        conv over each row's [slot history | chunk], one zero-state varlen scan, then each row's initial
        state's part added to its outputs and its final state written (hybrid/ops/triton_mamba_varlen.py);
        every slot ends as _prefill_row would leave it, up to rounding. Returns y [T, heads, head_dim], or
        None where the scan's varlen path is not available (then the caller runs the rows one by one:
        nothing was written)."""
        cfg = mixer.cfg
        inner, nh, P, G, N = cfg.intermediate_size, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        if not self.chunk_scan.lean:
            return None
        T = xBC.shape[0]
        xbc = tv.conv_prefill_varlen(xBC, conv_state, rows, mixer.conv_weight, mixer.conv_bias)
        x, B, C = torch.split(xbc, [inner, G * N, G * N], dim=-1)
        x, B, C = x.reshape(T, nh, P), B.reshape(T, G, N), C.reshape(T, G, N)
        y, dt_out = self.chunk_scan.varlen(x[None], dt[None], p["A"], B[None], C[None], cfg.chunk_size, p["D"],
                                           p["dt_bias"], tuple(cfg.dt_limit), rows.seq_of_token[None])
        tv.finish_rows(y[0], x, B, C, dt_out, p["A"], ssm_state, rows)
        return y[0]

    @torch.inference_mode()
    def warm_up_prefill(self, mixer, conv_state: torch.Tensor, ssm_state: torch.Tensor, max_tokens: int,
                        dtype: torch.dtype, varlen_tokens: int | None = None) -> int:
        """Run the prefill path once per length of prefill_warmup_lengths (and pointer alignment class),
        from a zero and from a given state, on the pool's scratch row (the last, which no request
        owns; left zero), so that the Triton specialisations a prefill chunk can meet are compiled (or
        loaded from the on-disk cache) now rather than under the first requests that meet them.
        With the "varlen_prefill" switch, the varlen path too, at the same total lengths as two rows.
        Returns the launches run."""
        cfg = mixer.cfg
        inner, nh = cfg.intermediate_size, cfg.num_heads
        scratch = conv_state.shape[0] - 1
        p = self.params(mixer)
        runs = 0
        width = inner + cfg.conv_dim + nh
        # Triton also specialises pointers on 16-byte alignment: a request's rows start at row
        # `start` of the in_proj output, so with rows of a width that is no multiple of 16 bytes
        # other alignments occur; starting rows 0..15 meet every one (16 / gcd of the widths)
        row_bytes = width * dtype.itemsize
        varlen = switch("varlen_prefill") and self.decode_kernels == "triton"
        first_rows = range(16 // math.gcd(row_bytes, 16))
        def in_proj_rows(first: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
            """(xBC, dt) of an in_proj-shaped output's rows, as the forward's split gives them (same strides)."""
            zxbcdt = torch.zeros(first + length, width, dtype=dtype, device=conv_state.device)[first:]
            return torch.split(zxbcdt, [inner, cfg.conv_dim, nh], dim=-1)[1:]

        done = prefill_warmup_lengths(cfg.chunk_size, max_tokens)
        for length in done:
            for first in first_rows:
                xBC, dt = in_proj_rows(first, length)
                for has_init in (False, True):
                    self._prefill_row(mixer, p, xBC, dt, conv_state, ssm_state, scratch, has_init)
                    runs += 1
                    if varlen and length >= 2:  # the same total length as two rows (both on the scratch row)
                        rows = tv.varlen_rows([length - 1, 1], [scratch, scratch], [has_init, True], conv_state.device)
                        runs += self._prefill_varlen(mixer, p, xBC, dt, conv_state, ssm_state, rows) is not None
        if varlen:  # the varlen scan's further integer classes (see varlen_warmup_lengths), as two rows
            # (a step's rows total up to varlen_tokens, the step's token budget, which may exceed max_model_len)
            for length in sorted(set(varlen_warmup_lengths(cfg.chunk_size, varlen_tokens or max_tokens)) - set(done)):
                xBC, dt = in_proj_rows(0, length)
                rows = tv.varlen_rows([length - 1, 1], [scratch, scratch], [False, True], conv_state.device)
                runs += self._prefill_varlen(mixer, p, xBC, dt, conv_state, ssm_state, rows) is not None
        conv_state[scratch].zero_()
        ssm_state[scratch].zero_()
        return runs


    def _library_conv_prefill(self, mixer, x: torch.Tensor, conv_state: torch.Tensor, slot: int,
                              has_init: bool) -> torch.Tensor:
        """causal-conv1d's causal_conv1d_fn over [slot history | chunk] (channel-first: transposes)."""
        width = conv_state.shape[-1]
        xr = x.t()  # [C, L]
        if has_init:
            history = conv_state[slot].to(xr.dtype)
        else:
            history = torch.zeros(xr.shape[0], width, dtype=xr.dtype, device=xr.device)
        window = torch.cat([history, xr], dim=-1)  # [C, K-1 + L]
        conv_state[slot] = window[:, -width:].to(conv_state.dtype)
        out = self.conv_fn(window[None], mixer.conv_weight, mixer.conv_bias, activation="silu")
        return out[0, :, width:].t().contiguous()  # [L, C]

    def _library_replay(self, mixer, xBC: torch.Tensor, dt: torch.Tensor, p: dict[str, torch.Tensor], y: torch.Tensor,
                        batch, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Replay rows with the library decode kernels: one token position per call, batched across
        the rows still active there, in place on their slots (replay rows are never padding)."""
        for pos in step_metadata(batch).replay_positions:
            tok = pos.tokens
            y[tok] = self._library_step(mixer, p, xBC[tok], dt[tok], conv_state, ssm_state, pos.slots).to(y.dtype)

    def _library_step(self, mixer, p: dict[str, torch.Tensor], xBC: torch.Tensor, dt: torch.Tensor,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token per row through causal-conv1d's and mamba-ssm's decode kernels, on state rows
        `slots` (real slots or the scratch row: never negative). Returns y [n, H, P]."""
        cfg = mixer.cfg
        n, nh, P, G, N = xBC.shape[0], cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size
        xbc = self.conv_update(xBC.contiguous(), conv_state, mixer.conv_weight, mixer.conv_bias,
                               "silu", None, slots.to(torch.int32))
        x, B, C = torch.split(xbc, [cfg.intermediate_size, G * N, G * N], dim=-1)
        return self.state_update(
            ssm_state, x.reshape(n, nh, P), dt[:, :, None].expand(n, nh, P), p["A_hpn"],
            B.reshape(n, G, N), C.reshape(n, G, N), D=p["D_hp"], z=None, dt_bias=p["dt_bias_hp"],
            dt_softplus=True, state_batch_indices=slots,
        )


def triton_recurrence(tm, mixer, params: dict[str, torch.Tensor], xBC: torch.Tensor, dt: torch.Tensor,
                      conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                      scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                      scratch_index: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode recurrence on our Triton kernels for token rows xBC [b, C] (one token each) or
    [b, T, C] (T tokens each): conv window, then the state update, starting from `slots`. Without
    `scratch` the slots are updated in place; with it (conv, ssm scratch views with T positions) the
    state after every token goes to scratch row `scratch_index` and the slots are untouched.
    Returns y [b, H, P] / [b, T, H, P] (written into `out` when given)."""
    conv_scr, ssm_scr = scratch if scratch is not None else (None, None)
    xbc = tm.conv_state_update(xBC, conv_state, mixer.conv_weight, mixer.conv_bias, slots,
                               intermediate_states=conv_scr, intermediate_indices=scratch_index)
    return triton_ssm_step(tm, mixer, params, xbc, dt, ssm_state, slots, out=out, scratch=ssm_scr,
                           scratch_index=scratch_index)


def triton_ssm_step(tm, mixer, params: dict[str, torch.Tensor], xbc: torch.Tensor, dt: torch.Tensor,
                    ssm_state: torch.Tensor, slots: torch.Tensor, *, out: torch.Tensor | None = None,
                    scratch: torch.Tensor | None = None, scratch_index: torch.Tensor | None = None) -> torch.Tensor:
    """The state update of the decode recurrence from the conv's output xbc [b, C] / [b, T, C] (see
    triton_recurrence). Returns y [b, H, P] / [b, T, H, P]."""
    x, B, C = ssm_operands(mixer.cfg, xbc)
    return tm.selective_state_update(ssm_state, x, dt, params["A"], B, C, params["D"], params["dt_bias"], slots,
                                     out=out, intermediate_states=scratch, intermediate_indices=scratch_index)


def ssm_operands(cfg, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output xbc [..., C] as the state update's x [..., H, P], B and C [..., G, N] (views)."""
    lead = xbc.shape[:-1]
    gn = cfg.n_groups * cfg.state_size
    x, B, C = torch.split(xbc, [cfg.intermediate_size, gn, gn], dim=-1)
    return (x.reshape(*lead, cfg.num_heads, cfg.head_dim), B.reshape(*lead, cfg.n_groups, -1),
            C.reshape(*lead, cfg.n_groups, -1))


def triton_replay(tm, mixer, xBC: torch.Tensor, dt: torch.Tensor, params: dict[str, torch.Tensor], y: torch.Tensor,
                  batch, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
    """Replay rows [num_decodes + num_verify, ... + num_replay) on our Triton decode kernels: the decode
    recurrence over each row's known tokens, in place on its slot (the slot ends with the state after the
    row's last token). Same math as Mamba2Mixer._replay. One T-token launch per token count: the kernels
    round the state to its dtype after every token, so this equals T one-token decodes in any state dtype.
    The row groups (token rows [b, T], slots) come from the step's metadata (hybrid/mamba_metadata.py)."""
    for g in step_metadata(batch).replay_groups:
        tok = g.tokens  # [b, T]
        y[tok] = triton_recurrence(tm, mixer, params, xBC[tok], dt[tok], conv_state, ssm_state, g.slots).to(y.dtype)


def triton_verify(tm, mixer, xBC: torch.Tensor, dt: torch.Tensor, params: dict[str, torch.Tensor], y: torch.Tensor,
                  batch, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
    """Speculative verify rows [num_decodes, num_decodes + num_verify) on our Triton kernels: the decode
    recurrence over each row's 1 + drafts tokens, starting from its slot, with the state after every
    token written to the verify scratch (the slot itself is untouched; the engine commits the accepted
    position). Same math as Mamba2Mixer._verify, and bit for bit what T one-token decodes would store
    (the kernels' state contract). One T-token launch per token count; the row groups (token rows,
    slots, scratch rows) come from the step's metadata (hybrid/mamba_metadata.py)."""
    conv_scr = batch.state_scratch[0][mixer.layer_index]  # [rows, K+1, conv_dim, K-1]
    ssm_scr = batch.state_scratch[1][mixer.layer_index]  # [rows, K+1, H, P, N]
    for g in step_metadata(batch).verify_groups:
        T, tok = g.num_tokens, g.tokens  # tok [b, T]
        y[tok] = triton_recurrence(tm, mixer, params, xBC[tok], dt[tok], conv_state, ssm_state, g.slots,
                                   (conv_scr[:, :T], ssm_scr[:, :T]), g.scratch).to(y.dtype)


def attach_kernels(model, decode_kernels: str = "triton") -> MambaCudaKernels | None:
    """Install the CUDA kernels on every Mamba mixer of a CUDA model; None (torch path) if unavailable."""
    mixers = model.mamba_mixers()
    if not mixers or not kernels_available():
        return None
    # the kernels' conv ends in silu and keeps a K-1 >= 1 wide history: anything else runs the torch path
    if any(m.cfg.conv_act != "silu" or m.cfg.conv_kernel < 2 for m in mixers):
        return None
    if mixers[0].A_log.device.type != "cuda":
        return None
    kernels = MambaCudaKernels(decode_kernels)
    for m in mixers:
        m.kernels = kernels
    return kernels


def _int_class(n: int) -> str:
    """Triton's specialisation class of an integer argument: 1, a multiple of 16, or other."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "other"


def prefill_warmup_lengths(chunk_size: int, max_tokens: int) -> list[int]:
    """Prefill chunk lengths (at most max_tokens) that between them meet every specialisation class
    Triton compiles the chunked scan's kernels for: their integer arguments are specialised by value
    (1, a multiple of 16, anything else), the sequence length and the chunk count among them, so a
    chunk of 16 x k tokens, or one of 16 chunks, compiles kernels a chunk of 37 tokens did not. For
    each (length class, chunk-count class) pair some chunk can have, the shortest such length. The scan
    also takes chunk count x chunk size (a stride): with a chunk size that is no multiple of 16 (tiny
    test models), its class follows the count's parity, so that class is part of the key too."""
    shortest: dict[tuple[str, str, str], int] = {}
    for n in range(1, min(max_tokens, 17 * chunk_size + 16) + 1):  # past that, no new class
        chunks = -(-n // chunk_size)
        shortest.setdefault((_int_class(n), _int_class(chunks), _int_class(chunks * chunk_size)), n)
    return sorted(shortest.values())


def varlen_warmup_lengths(chunk_size: int, max_tokens: int) -> list[int]:
    """Total token counts (2 to max_tokens) of a varlen prefill step that between them meet every
    specialisation class of the varlen scan's integer arguments. A step's total is any sum of its
    rows, and the scan's kernels also take products of it and of its chunk count (strides such as
    T x row width or chunks x chunk size), whose class (a multiple of 16 or not) follows the residues
    mod 16: so one total for each (T mod 16, chunk count 1 or its residue mod 16), the shortest.
    (Measured: a warm-up of prefill_warmup_lengths alone left mamba-ssm's cumsum and state-passing
    kernels to compile under the first mixed batches.)"""
    shortest: dict[tuple[int, int], int] = {}
    for n in range(2, max_tokens + 1):
        chunks = -(-n // chunk_size)
        shortest.setdefault((n % 16, -1 if chunks == 1 else chunks % 16), n)
        if n > 17 * max(chunk_size, 16):  # every pair has met its shortest total by now
            break
    return sorted(shortest.values())
