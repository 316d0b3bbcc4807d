"""The server's Prometheus metrics (prometheus-client), named as vLLM names its own with our prefix, so dashboards
built for one read the other: requests running and waiting, the engine's free cache pages, token counters, time to
first token, inter-token latency, finished requests by reason (a client that left counts as `abort`, a failed
generation as `error`), and DSpark's acceptance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip


class ServingMetrics:
    """One registry per server (tests run several in a process)."""

    def __init__(self, model_id: str):
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def bind(metric):
            return metric.labels(model_name=model_id)

        self.running = bind(Gauge("inkling2:num_requests_running", "Requests in the engine's rows.", **labels))
        self.waiting = bind(
            Gauge("inkling2:num_requests_waiting", "Requests queued, or in the engine until pages free up.", **labels)
        )
        self.free_pages = bind(
            Gauge("inkling2:kv_cache_free_pages", "Free pages of the engine's paged key/value cache.", **labels)
        )
        self.prompt_tokens = bind(Counter("inkling2:prompt_tokens", "Prompt tokens, image tokens included.", **labels))
        self.generation_tokens = bind(Counter("inkling2:generation_tokens", "Generated tokens.", **labels))
        self.time_to_first_token = bind(
            Histogram("inkling2:time_to_first_token_seconds", "Request received -> first token.",
                      buckets=LATENCY_BUCKETS, **labels)  # fmt: skip
        )
        self.inter_token_latency = bind(
            Histogram("inkling2:inter_token_latency_seconds", "Time between a request's tokens.",
                      buckets=LATENCY_BUCKETS, **labels)  # fmt: skip
        )
        self.request_latency = bind(
            Histogram("inkling2:e2e_request_latency_seconds", "Request received -> last token.",
                      buckets=LATENCY_BUCKETS, **labels)  # fmt: skip
        )
        self._finished = Counter(
            "inkling2:request_success",
            "Finished requests by finish reason ('abort': the client left; 'error': the generation failed).",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.finished = lambda reason: self._finished.labels(model_name=model_id, finished_reason=reason).inc()
        self.spec_decode_drafts = bind(
            Counter("inkling2:spec_decode_num_draft_tokens", "Tokens DSpark drafted.", **labels)
        )
        self.spec_decode_accepted = bind(
            Counter("inkling2:spec_decode_num_accepted_tokens", "Drafted tokens the model accepted.", **labels)
        )
        self.spec_decode_steps = bind(Counter("inkling2:spec_decode_num_steps", "DSpark draft-verify steps.", **labels))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["ServingMetrics"]
