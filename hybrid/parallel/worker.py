"""The worker process of rank r >= 1: loads its shard, then runs every step the driver sends on it.

It never decides anything: the batch (slots, padding, pages) and the state writes between steps
come from the driver. On any error it reports the traceback on its pipe and exits, which closes
its sockets, so the driver's collectives fail instead of waiting."""
from __future__ import annotations

import os
import traceback

import torch

from hybrid.parallel import protocol


def _device(spec: protocol.WorkerSpec, rank: int) -> torch.device:
    if spec.device_type == "cuda":
        device = torch.device("cuda", spec.first_device_index + rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def worker_main(rank: int, world_size: int, port: int, conn, spec: protocol.WorkerSpec) -> None:
    try:
        torch.set_num_threads(spec.num_threads)
        conn.send_bytes(protocol.dumps(("hello", rank)))
        _serve(rank, world_size, port, conn, spec)
    except BaseException:
        try:
            conn.send_bytes(protocol.dumps(("error", rank, traceback.format_exc())))
        except Exception:  # the driver is gone: nothing to tell
            pass
        os._exit(1)  # no teardown of the process group: the peers must see the sockets close now
    os._exit(0)


def _serve(rank: int, world_size: int, port: int, conn, spec: protocol.WorkerSpec) -> None:
    from attention.backend import select_backend
    from attention.kv_cache import PagedKVCache
    from graphs.runner import ModelRunner
    from hybrid.config_parse import load_config
    from hybrid.loader import load_model
    from hybrid.model import ForwardContext, use_fused_ops
    from hybrid.parallel.group import TPGroup, make_store
    from hybrid.parallel.shard_model import ShardPlan
    from state_pool.pool import MambaStatePool, StateShapes

    device = _device(spec, rank)
    group = TPGroup(make_store(world_size, rank, port), rank, world_size, device)
    cfg = load_config(spec.model_dir)
    plan = ShardPlan(cfg, group)
    model = load_model(spec.model_dir, cfg, device, spec.dtype, check_finite=spec.check_weights, shard=plan)
    local = plan.local_cfg
    if spec.fused_ops:
        use_fused_ops(model)
    if device.type == "cuda":
        from hybrid.ops.mamba_cuda import attach_kernels

        attach_kernels(model, spec.mamba_decode_kernels)
    backend = select_backend(device)
    conn.send_bytes(protocol.dumps(("loaded", rank)))
    pool = kv = runner = None
    # test hook (tests/test_tensor_parallel.py): this rank raises at its N-th step
    fault_at = int(os.environ.get(f"HYBRID_TP_FAULT_RANK{rank}_STEP", "0"))
    steps = 0
    while True:
        msg = protocol.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "step":
            _, ops, data = msg
            steps += 1
            if steps == fault_at:
                raise RuntimeError(f"injected fault at step {steps} (HYBRID_TP_FAULT_RANK{rank}_STEP)")
            protocol.apply_ops(ops, pool, kv)
            runner.execute(protocol.decode_batch(data, device, pool))
        elif kind == "plan":  # the driver's memory-plan trial: the same profiling forwards, in step
            from graphs.memory import plan_memory
            from hybrid.errors import CapacityError

            try:
                plan_memory(model, local, device=device, attention_backend=backend, **msg[1])
            except CapacityError:  # the driver sees the same and tries smaller sizes
                pass
        elif kind == "setup":
            s: protocol.SetupSpec = msg[1]
            m, a = local.mamba, local.attention
            shapes = StateShapes(len(local.mamba_layers), m.conv_dim, m.conv_kernel - 1, m.num_heads, m.head_dim,
                                 m.state_size)
            pool = MambaStatePool(shapes, s.num_slots, device, conv_dtype=s.conv_dtype, ssm_dtype=s.ssm_dtype)
            if s.spec_scratch is not None:
                pool.enable_spec_scratch(*s.spec_scratch)
            kv = PagedKVCache(len(local.attention_layers), s.num_kv_pages, s.page_size, a.num_kv_heads, a.head_dim,
                              device, spec.dtype)
            runner = ModelRunner(model, ForwardContext(pool, kv, backend), enforce_eager=s.enforce_eager,
                                 max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len, page_size=s.page_size,
                                 cuda_graph_sizes=s.cuda_graph_sizes, progress=False, piecewise_max_tokens=0,
                                 num_speculative_tokens=s.spec_scratch[1] - 1 if s.spec_scratch else 0)
            conn.send_bytes(protocol.dumps(("ready", rank)))
        elif kind == "probe":  # which slots hold NaN (poisoned) on this rank: the sanitizer's view, per rank
            protocol.apply_ops(msg[1], pool, kv)
            conn.send_bytes(protocol.dumps(("probe", rank, protocol.slots_with_nan(pool))))
        elif kind == "stop":
            return
        else:
            raise AssertionError(f"unknown message {kind!r}")
