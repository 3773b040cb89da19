"""Prometheus metrics of a server: engine gauges and counters read from the latest step's
stats at scrape time, per-request latency histograms observed as requests finish.

Each server has its own registry, so several servers (tests, replicas) in one process do not
collide on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cbatch.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine = None  # an AsyncEngine, once attached
        labels = ["model_name"]
        self.ttft = Histogram("cbatch_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("cbatch_time_per_output_token_seconds",
                              "Time per output token after the first", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("cbatch_e2e_request_latency_seconds", "Arrival to last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("cbatch_request_finished", "Requests finished, by reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.registry.register(self)

    def attach(self, engine) -> None:
        self.engine = engine

    def observe(self, out: RequestOutput) -> None:
        """Called on the engine thread for every finished request."""
        m = out.metrics
        self.finished.labels(self.model_name, out.finish_reason).inc()
        if out.finish_reason in ("abort", "error"):
            return  # an aborted or failed request's latencies are not the server's pace
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
            if value is not None:
                histogram.labels(self.model_name).observe(value)

    def collect(self):
        """The engine's own numbers, as of its latest step (a prometheus_client collector)."""
        if self.engine is None:
            return
        stats = self.engine.stats
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family_type, name, doc, value in (
                (gauge, "cbatch_num_requests_running", "Requests in the running batch",
                 stats.num_running),
                (gauge, "cbatch_num_requests_waiting", "Requests waiting to be scheduled",
                 stats.num_waiting),
                (gauge, "cbatch_kv_cache_usage_perc", "Fraction of KV-cache blocks in use",
                 stats.kv_cache_usage),
                (counter, "cbatch_num_preemptions", "Preemptions (recompute)",
                 stats.num_preemptions),
                (counter, "cbatch_prompt_tokens", "Tokens computed in prefill",
                 stats.num_prefill_tokens),
                (counter, "cbatch_generation_tokens", "Tokens generated",
                 stats.num_output_tokens),
                (counter, "cbatch_prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache", stats.prefix_cache_queried_tokens),
                (counter, "cbatch_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 stats.prefix_cache_hit_tokens)):
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if stats.steps_by_threads:  # a CPU engine: how many threads its steps ran on
            family = CounterMetricFamily("cbatch_cpu_steps", "Steps, by CPU threads used",
                                         labels=["model_name", "threads"])
            for threads, steps in sorted(stats.steps_by_threads.items()):
                family.add_metric([self.model_name, str(threads)], steps)
            yield family
        if stats.spec_decode_num_accepted_tokens_per_pos:  # a speculative engine
            yield from self._spec_decode(stats)

    def _spec_decode(self, stats):
        """Speculative decoding's counters, vLLM's ``vllm:spec_decode_*`` under this
        server's prefix."""
        for name, doc, value in (
                ("num_drafts", "Sequences that verified drafts, summed over steps",
                 stats.spec_decode_num_drafts),
                ("num_draft_tokens", "Draft tokens verified",
                 stats.spec_decode_num_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted",
                 stats.spec_decode_num_accepted_tokens),
                ("draft_seconds", "Seconds spent drafting", stats.spec_decode_draft_s),
                ("verify_seconds", "Wall seconds of the steps that verified drafts",
                 stats.spec_decode_verify_s)):
            family = CounterMetricFamily(f"cbatch_spec_decode_{name}", doc,
                                         labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = CounterMetricFamily("cbatch_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by their position in the draft",
                                     labels=["model_name", "position"])
        for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            family.add_metric([self.model_name, str(pos)], value)
        yield family

    def render(self) -> bytes:
        return generate_latest(self.registry)
