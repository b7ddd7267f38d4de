"""The sampler's fallback kernel alone (hybrid/ops/triton_sampling.py fallback_kernel), in variants of its search,
in one process. (The previous kernel, int64 masses and 12 passes, was measured against it on 2026-12-06:
bench/results/sampler_kernel_9873ac0_h100.log, BENCHMARKS.md.)

    python3 bench/bench_sampler_kernel.py --sass      # no GPU needed: compiled for sm_90, SASS of the search loop
    python3 bench/bench_sampler_kernel.py --device    # CUDA: each variant timed alone, tokens checked

--sass prints, per variant and with / without top-k: registers, local memory (spills), and the instruction
count of the top-p search pass's inner loop per token (the loop's SASS over the tokens one thread handles an
iteration) with its instruction mix.

--device: 256 rows x 131072 probabilities (softmax of N(0, 1.3^2) logits: the flat rows of a random model,
which all fall back), top-p 0.95 without and with top-k 50 (every row forced through the kernel, as rows
not covered by the prefilter are, the top-k ones too); each variant's tokens checked against the torch redo
(hybrid/sampling.py `_redo_sorted`), then CUDA-event timing of --reps launches. Columns: us per launch, full-
row passes (search passes, worst case from each row's start interval, + the draw's ~0.5), us per pass, GB/s
per pass (the probabilities, and the logits with top-k, of every row), and `ref` (tokens equal to the torch
redo's). The first line times torch's read of the probabilities (a row sum) for the device's read rate.

Variants (--variants, comma-separated): p8 (today's, as hybrid/sampling.py launches it on GPUs with fast
float64), p8-int (int64 masses, as on the others), p16 (16 pivots a pass), p8-full (8 pivots, the search
started at the whole range instead of the prefilter's cut: the start
bound's share).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hybrid.sampling as sampling  # noqa: E402
from hybrid.ops import triton_sampling  # noqa: E402
from hybrid.ops.triton_guard import HAS_TRITON, tl, triton  # noqa: E402

TILE = sampling.FALLBACK_TILE
NUM_WARPS = 8
DEV = "cuda"
# variant -> (kernel, constexprs but TOP_K, whether the search starts at the prefilter's cut)
VARIANTS = {
    "p8": ("new", dict(PIVOTS=8, INT_MASSES=False), True),
    "p8-int": ("new", dict(PIVOTS=8, INT_MASSES=True), True),
    "p16": ("new", dict(PIVOTS=16, INT_MASSES=False), True),
    "p8-full": ("new", dict(PIVOTS=8, INT_MASSES=False), False),
}
PTRS = dict(v_ptr="*fp32", p_ptr="*fp32", covered_ptr="*i32", top_k_ptr="*i64", kth_ptr="*fp32",
            top_p_ptr="*fp64", cut_ptr="*fp32", floor_ptr="*fp32", u_ptr="*fp64", out_ptr="*i64")
# a line of each kernel's search loop body: the loop --sass counts is the innermost one holding it
MARKERS = {"new": "acc += tl.sum(_signed_masses("}


def _kernel(kind: str):
    return triton_sampling.fallback_kernel


def _constexprs(name: str, top_k: bool) -> dict:
    return dict(TOP_K=top_k, TOP_P=True, MIN_P=True, ROWS=TILE[0], EPT=TILE[1], **VARIANTS[name][1])


# ------------------------------------------------------------------------------------------ --sass
def _tool(name: str) -> str:
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name}: not in triton's wheel nor on PATH")
    return found


def _compile_sm90(name: str, top_k: bool):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel(VARIANTS[name][0])
    constexprs = _constexprs(name, top_k)
    sig = {p: ("constexpr" if p in constexprs else PTRS.get(p, "i32")) for p in fn.arg_names}
    # pointers and V divisible by 16, as a launch on the device specialises them (16-byte loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names) if sig[p] != "constexpr"}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS, num_stages=3))


def _marker_line(kind: str) -> tuple[str, int]:
    path = Path(triton_sampling.__file__).resolve()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if MARKERS[kind] in line:
            return path.name, n
    raise LookupError(f"no line with {MARKERS[kind]!r} in {path}")


def _parse_sass(text: str) -> tuple[list[tuple[str, tuple[str, int] | None]], dict[str, int]]:
    """(instructions as (text, (file, line)), label -> instruction index) of nvdisasm -g output."""
    instrs, labels, where = [], {}, None
    for line in text.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append((m.group(1), where))
    return instrs, labels


def _opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", ins).split()[0].split(".")[0]


def sass_report(name: str, top_k: bool) -> dict:
    kernel = _compile_sm90(name, top_k)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-g", cubin], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1)) + int(re.search(r"STACK:(\d+)", usage).group(1))
    instrs, labels = _parse_sass(sass)
    loops = []  # (first, last) of each backward branch's body
    for i, (ins, _) in enumerate(instrs):
        m = re.search(r"BRA\b.*`\((\.L_x_\d+)\)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append((labels[m.group(1)], i))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    marker = _marker_line(VARIANTS[name][0])
    body = next(instrs[a:b + 1] for a, b in innermost if any(w == marker for _, w in instrs[a:b + 1]))
    mix: dict[str, int] = {}
    for ins, _ in body:
        mix[_opcode(ins)] = mix.get(_opcode(ins), 0) + 1
    tokens = TILE[0] * TILE[1] // (NUM_WARPS * 32)  # tokens a thread handles an iteration
    return dict(regs=regs, local=local, instrs=len(body), per_token=len(body) / tokens, tokens=tokens,
                mix=dict(sorted(mix.items(), key=lambda kv: -kv[1])))


def run_sass(names: list[str]) -> None:
    print(f"sm_90, {NUM_WARPS} warps, tile {TILE[0]}x{TILE[1]}; search loop = the innermost loop of the top-p pass")
    print(f"{'variant':9} {'top-k':5} {'regs':>4} {'spill B':>7} {'loop instrs':>11} {'/token':>7}  mix (per token)")
    for name in names:
        for top_k in (False, True):
            try:
                r = sass_report(name, top_k)
            except Exception as e:  # noqa: BLE001 - one line per variant
                print(f"{name:9} {str(top_k):5} failed: {e!r}"[:200])
                continue
            mix = " ".join(f"{op} {n / r['tokens']:.2f}" for op, n in r["mix"].items())
            print(f"{name:9} {str(top_k):5} {r['regs']:4d} {r['local']:7d} {r['instrs']:11d} {r['per_token']:7.2f}  {mix}")


# ---------------------------------------------------------------------------------------- --device
def _inputs(rows: int, V: int, sd: float, top_k: int | None, seed: int = 0):
    """What _fallback_kernel_launch passes, for `rows` flat rows, top-p 0.95 (and top-k), every row
    uncovered: scaled logits, probabilities, prefilter cuts, knobs, draws."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    scaled = torch.randn(rows, V, device=DEV, generator=g) * sd
    probs = torch.softmax(scaled, dim=-1)
    knobs = sampling._Knobs(top_k=torch.full((rows,), top_k, device=DEV) if top_k else None,
                            top_p=torch.full((rows,), 0.95, dtype=torch.float64, device=DEV), min_p=None)
    C = max(sampling.PREFILTER_CANDIDATES, (top_k or 0) + 1)
    vals, ids = torch.topk(scaled, C, dim=-1)
    cuts = sampling._cuts(vals, probs.gather(1, ids), knobs)[0]
    covered = torch.zeros(rows, dtype=torch.bool, device=DEV)
    u = torch.rand(rows, dtype=torch.float64, device=DEV, generator=g)
    return scaled, probs, covered, cuts, knobs, u


def _launcher(name: str, scaled, probs, covered, cuts, knobs, u, out):
    kind, consts, start_at_cut = VARIANTS[name]
    rows, V = scaled.shape
    dev = scaled.device
    top_k = knobs.top_k if knobs.top_k is not None else torch.zeros(1, dtype=torch.long, device=dev)
    kth = cuts.kth if cuts.kth is not None else torch.full((1,), -math.inf, device=dev)
    floor = torch.zeros(rows, device=dev)
    cov = covered.to(torch.int32)
    meta = dict(TOP_K=cuts.kth is not None, TOP_P=True, MIN_P=True, ROWS=TILE[0], EPT=TILE[1], num_warps=NUM_WARPS,
                **consts)
    cut = cuts.cut if start_at_cut else torch.full_like(cuts.cut, math.inf)  # inf: the whole range
    return lambda: triton_sampling.fallback_kernel[(rows,)](scaled, probs, cov, top_k, kth, knobs.top_p, cut, floor, u,
                                                           out, V, **meta)


def _passes(name: str, cuts, top_k: bool) -> float:
    """Full-row passes of a launch: the search's worst case from each row's start interval, plus the draw
    (about half a row on average)."""
    kind, consts, start_at_cut = VARIANTS[name]
    P = consts["PIVOTS"]
    his = cuts.cut.view(torch.int32).tolist() if start_at_cut else [0x7F800000] * cuts.cut.numel()
    counts = []
    for hi in his:
        length, n = hi + 1, 0
        while length > 1:
            length, n = -(-length // P), n + 1
        counts.append(n)
    return sum(counts) / len(counts) + 0.5


def _time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def run_device(names: list[str], rows: int, V: int, sd: float, reps: int) -> None:
    if not torch.cuda.is_available():
        sys.exit("--device needs CUDA")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{rows} rows x {V}, logits N(0, {sd}^2), top-p 0.95, every row through the kernel, {reps} launches each")
    probs = torch.softmax(torch.randn(rows, V, device=DEV) * sd, dim=-1)
    read_us = _time_us(lambda: probs.sum(dim=-1), reps)
    print(f"torch row sum (reads the probabilities once): {read_us:.1f} us, {probs.numel() * 4 / read_us / 1e3:.0f} GB/s")
    del probs
    print(f"{'filters':16} {'variant':8} {'us/launch':>9} {'passes':>6} {'us/pass':>7} {'GB/s':>5}  ref")
    for top_k in (None, 50):
        inputs = _inputs(rows, V, sd, top_k)
        scaled, probs, covered, cuts, knobs, u = inputs
        want = torch.zeros(rows, dtype=torch.long, device=DEV)
        sampling._redo_sorted(scaled, probs, covered, knobs, u, want)
        label = "top-p" if top_k is None else f"top-p + top-k {top_k}"
        for name in names:
            out = torch.full((rows,), -1, dtype=torch.long, device=DEV)
            try:
                launch = _launcher(name, *inputs, out)
                launch()
                torch.cuda.synchronize()
                same = bool(torch.equal(out, want))
                us = _time_us(launch, reps)
            except Exception as e:  # noqa: BLE001 - one line per variant
                print(f"{label:16} {name:8} failed: {e!r}"[:300])
                continue
            passes = _passes(name, cuts, top_k is not None)
            per_pass_bytes = rows * V * 4 * (2 if top_k else 1)
            print(f"{label:16} {name:8} {us:9.1f} {passes:6.1f} {us / passes:7.1f} "
                  f"{per_pass_bytes / (us / passes) / 1e3:5.0f}  {'equal' if same else 'DIFFERENT'}")
        del inputs, scaled, probs
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sass", action="store_true", help="compile for sm_90 and count the search loop's SASS")
    mode.add_argument("--device", action="store_true", help="time each variant on CUDA")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--sd", type=float, default=1.3, help="the logits' standard deviation (flat rows: all fall back)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not HAS_TRITON:
        sys.exit("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1")
    names = [n for n in args.variants.split(",") if n]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"unknown variants {sorted(unknown)}: choose from {sorted(VARIANTS)}")
    if args.sass:
        run_sass(names)
    else:
        run_device(names, args.rows, args.vocab, args.sd, args.reps)


if __name__ == "__main__":
    main()
