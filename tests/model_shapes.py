"""config.json of real-sized models (no weights), for memory-plan arithmetic and GPU startup tests."""

# Nemotron-H-8B's layout and dims: bench/bench_decode.py's CONFIG (24 Mamba2 layers, 4 attention
# layers, 97.4 MiB of Mamba state per sequence with a bf16 conv and an fp32 SSM state).
from bench.bench_decode import CONFIG as NEMOTRON_H_8B  # noqa: E402

H200_BYTES = 141 * 10**9  # an H200's 141 GB
