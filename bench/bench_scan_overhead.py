"""Host cost of one prefill chunk's chunked scan (mamba-ssm's `mamba_chunk_scan_combined`), per call, at
the Nemotron-H-8B Mamba layer's dims: where a short eager prefill step's host time goes.

    python3 bench/bench_scan_overhead.py [--lengths 16 256] [--calls 200]

Per chunk length and initial state (none / given): the host time per call of calls issued back to back
(the device work per call is ~25 us, so above that the loop is bound by the host), for
- `public`: `mamba_chunk_scan_combined` as hybrid.ops.mamba_cuda calls it;
- `fwd`: its forward function without the autograd Function (`_mamba_chunk_scan_combined_fwd`);
- `lean`: hybrid.ops.mamba_scan.ChunkScan, what the prefill path runs (that forward, each kernel launched
  with the config its autotuner chose for the key, from a dict);
then a cProfile of the public and the lean call (top functions by own time). `public` and `fwd` run with
the library's own autotuners (the lean launchers taken out for them).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_call_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=128)
    args = ap.parse_args()
    from hybrid.ops.mamba_ssm_shim import mamba_ssm_triton

    from hybrid.ops.mamba_scan import ChunkScan, _install

    public, _ = mamba_ssm_triton()
    import importlib

    ssd = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    lean = ChunkScan()
    dev = torch.device("cuda")
    nh, P, G, N = 128, 64, 8, 128
    width = nh * P + 2 * G * N + nh
    A = -torch.rand(nh, device=dev) - 0.5
    D = torch.randn(nh, device=dev)
    dt_bias = torch.randn(nh, device=dev) * 0.1
    for T in args.lengths:
        zx = torch.randn(T, width, device=dev, dtype=torch.bfloat16)
        x = zx[:, : nh * P].reshape(1, T, nh, P)
        B = zx[:, nh * P: nh * P + G * N].reshape(1, T, G, N)
        C = zx[:, nh * P + G * N: nh * P + 2 * G * N].reshape(1, T, G, N)
        dt = zx[:, -nh:][None]
        for init in (None, torch.randn(1, nh, P, N, device=dev)):
            kw = dict(D=D, z=None, dt_bias=dt_bias, initial_states=init, dt_softplus=True, dt_limit=(0.0, float("inf")))
            row = {"T": T, "init": init is not None}
            lean.uninstall()  # public and fwd through the library's own autotuners
            row["public_us"] = per_call_us(lambda: public(x, dt, A, B, C, args.chunk, return_final_states=True, **kw), args.calls)
            row["fwd_us"] = per_call_us(lambda: ssd._mamba_chunk_scan_combined_fwd(x, dt, A, B, C, args.chunk, **kw), args.calls)
            if lean.lean:
                lean.swapped = _install(lean.modules)
            row["lean_us"] = per_call_us(lambda: lean(x, dt, A, B, C, args.chunk, D, dt_bias, init, kw["dt_limit"]),
                                         args.calls)
            row["lean_path"] = lean.lean
            if T == args.lengths[0] and init is not None:
                for name, call in (("public", lambda: public(x, dt, A, B, C, args.chunk, return_final_states=True, **kw)),
                                   ("lean", lambda: lean(x, dt, A, B, C, args.chunk, D, dt_bias, init, kw["dt_limit"]))):
                    lean.uninstall()
                    if name == "lean" and lean.lean:
                        lean.swapped = _install(lean.modules)
                    call()  # (a fresh launcher's first call per key goes through the autotuner)
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(50):
                        call()
                    prof.disable()
                    torch.cuda.synchronize()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                    print(f"cProfile, 50 {name} calls:\n" + out.getvalue()[:5000], flush=True)
            print(row, flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
