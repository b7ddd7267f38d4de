"""Prometheus metrics of the HTTP server (one registry per app, so several apps can coexist)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Twin:
    """One figure kept under two names (ours and vLLM's): every update goes to both series."""

    def __init__(self, *series) -> None:
        self.series = series

    def inc(self, amount: float = 1) -> None:
        for m in self.series:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self.series:
            m.observe(value)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._labels = labels
        names = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(**labels)

        self.running = gauge("hybrid_num_requests_running", "Sequences running in the engine (holding a slot).")
        self.waiting = gauge("hybrid_num_requests_waiting", "Sequences waiting in the engine for a slot.")
        self.inflight = gauge("hybrid_num_requests_inflight",
                              "HTTP generation requests admitted and not yet answered in full.")
        self.seqs_admitted = gauge("hybrid_num_sequences_admitted",
                                   "Sequences (prompts x n) of the admitted HTTP requests; beyond max_num_seqs + "
                                   "max_queued_requests new requests get 429.")
        self.slots_used = gauge("hybrid_state_slots_in_use", "Mamba state slots in use (by anyone).")
        self.slots_requests = gauge("hybrid_state_slots_requests", "Mamba state slots held by running sequences.")
        self.slots_prefix = gauge("hybrid_state_slots_prefix_cache", "Mamba state slots held by the prefix cache.")
        self.pages_prefix = gauge("hybrid_kv_pages_prefix_cache",
                                  "KV pages the prefix cache holds a reference to (running sequences may share them).")
        self.slots_total = gauge("hybrid_state_slots_total", "Mamba state slots.")
        self.pages_used = gauge("hybrid_kv_pages_in_use", "KV cache pages in use.")
        self.pages_total = gauge("hybrid_kv_pages_total", "KV cache pages (without the reserved dummy page).")
        self.prefix_hit_tokens = gauge("hybrid_prefix_cache_hit_tokens",
                                       "Prompt tokens taken from the prefix cache instead of prefilled (total).")

        # The main figures also under vLLM's names (its dashboards and alerts read these): each update
        # goes to both series (Twin)
        def counter(name, vllm_name, doc):
            return Twin(*(Counter(n, doc, names, registry=r).labels(**labels) for n in (name, vllm_name)))

        def histogram(name, vllm_name, doc, buckets):
            return Twin(*(Histogram(n, doc, names, buckets=buckets, registry=r).labels(**labels)
                          for n in (name, vllm_name)))

        self.gen_tokens = counter("hybrid_generation_tokens", "vllm:generation_tokens", "Generated tokens.")
        self.prompt_tokens = counter("hybrid_prompt_tokens", "vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self._success = [Counter(n, "Finished requests by finish reason.", names + ["finished_reason"], registry=r)
                         for n in ("hybrid_request_success", "vllm:request_success")]
        self.aborted = Counter("hybrid_request_aborted", "Requests aborted (client gone).", names,
                               registry=r).labels(**labels)
        self._rejected = Counter("hybrid_request_rejected", "Requests rejected by status code.",
                                 names + ["status"], registry=r)
        self.ttft = histogram("hybrid_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                              "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("hybrid_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                              "Time between consecutive output tokens.", _LATENCY_BUCKETS)
        self.e2e = histogram("hybrid_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                             "End-to-end request latency.", _E2E_BUCKETS)
        self.vllm_running = gauge("vllm:num_requests_running", "vLLM's name: sequences running in the engine.")
        self.vllm_waiting = gauge("vllm:num_requests_waiting", "vLLM's name: sequences waiting for a slot.")
        self.vllm_kv_usage = gauge("vllm:kv_cache_usage_perc", "vLLM's name: KV cache pages in use (1 = all).")

    def bind(self, async_engine, admitted_requests=None, admitted_seqs=None) -> None:
        """Read the engine gauges from the worker's published snapshot at scrape time; who holds
        the slots (running sequences vs the prefix cache) is read from the engine itself, read
        only, so that slots held by neither (a leak, or a deferred free) show up as the rest of
        hybrid_state_slots_in_use. admitted_*: the server's admission counters."""
        snap = lambda key: (lambda: async_engine.snapshot[key])  # noqa: E731
        engine = async_engine.engine
        self.running.set_function(snap("running"))
        self.waiting.set_function(snap("waiting"))
        self.vllm_running.set_function(snap("running"))
        self.vllm_waiting.set_function(snap("waiting"))
        pages_total = max(async_engine._pages_total, 1)
        self.vllm_kv_usage.set_function(lambda: async_engine.snapshot["pages_used"] / pages_total)
        self.slots_used.set_function(snap("slots_used"))
        self.pages_used.set_function(snap("pages_used"))
        self.prefix_hit_tokens.set_function(snap("prefix_cache_hit_tokens"))
        self.inflight.set_function(admitted_requests or (lambda: async_engine.num_inflight))
        if admitted_seqs is not None:
            self.seqs_admitted.set_function(admitted_seqs)
        self.slots_requests.set_function(lambda: request_slots(engine))
        self.slots_prefix.set_function(lambda: len(prefix_cache_slots(engine)))
        self.pages_prefix.set_function(lambda: len(prefix_cache_pages(engine)))
        self.slots_total.set(async_engine._slots_total)
        self.pages_total.set(async_engine._pages_total)

    # called from the engine worker thread (prometheus_client metrics are thread-safe)
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def add_tokens(self, n: int) -> None:
        self.gen_tokens.inc(n)

    def on_finish(self, out, seconds: float, num_prompt_tokens: int) -> None:
        self.e2e.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        for c in out.outputs:
            for success in self._success:
                success.labels(finished_reason=c.finish_reason or "unknown", **self._labels).inc()

    def on_abort(self) -> None:
        self.aborted.inc()

    def on_reject(self, status: int) -> None:
        self._rejected.labels(status=str(status), **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# Read from the scrape thread while the engine worker runs: list() copies each container in one
# step under the GIL, so a concurrent change can make a count a step old but never raises.
def request_slots(engine) -> int:
    """Mamba slots held by running sequences."""
    return sum(1 for seq in list(engine.running) if seq.slot is not None)


def prefix_cache_slots(engine) -> set[int]:
    cache = getattr(engine, "prefix_cache", None)
    return set() if cache is None else {e.slot for e in list(cache.entries.values())}


def prefix_cache_pages(engine) -> set[int]:
    cache = getattr(engine, "prefix_cache", None)
    return set() if cache is None else {p for e in list(cache.entries.values()) for p in e.pages}
