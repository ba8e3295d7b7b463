"""The router's view of each request, recorded once and shown three ways: an
OpenTelemetry span (the root of the request's trace inside Outrider), Prometheus
metrics, and the live page's time series."""

from __future__ import annotations

import threading
import time

from opentelemetry import trace
from outrider.router.live import LiveStats

from outrider.telemetry.metrics import RouterMetrics
from outrider.telemetry.tracing import (
    context_from_metadata,
    request_attributes,
    spec_attributes,
    traceparent_of,
    tracer,
)


class RouterTelemetry:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.metrics = RouterMetrics(model_name)
        self.live = LiveStats()
        self._stop = threading.Event()
        self.live.run_sampler(self._stop)

    def request(self, context) -> RequestTelemetry:
        return RequestTelemetry(self, context)

    def close(self) -> None:
        self._stop.set()


class RequestTelemetry:
    """One request, from admission to its last message or refusal."""

    def __init__(self, owner: RouterTelemetry, context) -> None:
        self.owner, self.metrics, self.live = owner, owner.metrics, owner.live
        self.api = getattr(context, "api", "grpc")
        self.span = tracer().start_span(
            f"text_completion {owner.model_name}",
            context_from_metadata(context.invocation_metadata()), kind=trace.SpanKind.SERVER,
            attributes={"gen_ai.operation.name": "text_completion",
                        "gen_ai.provider.name": "outrider", "outrider.api": self.api})
        self.started = time.perf_counter()
        self.last_token_at: float | None = None
        self.outcome = "CANCELLED"  # unless it finishes or is refused
        self.constraint = ""  # the kind of its structured output, if any

    def admitted(self, job) -> None:
        so = job.params.structured_output
        self.constraint = so.kind if so is not None else ""
        self.span.set_attributes({
            **request_attributes(self.owner.model_name, job.params, job.request_id),
            "gen_ai.usage.input_tokens": len(job.prompt_ids),
            "outrider.spec.mode": job.mode.value, "outrider.spec.gamma_max": job.gamma_max,
            "outrider.tag": job.tag, "outrider.structured_output": self.constraint})

    def traceparent(self) -> str:
        """The trace context work done for this request elsewhere joins."""
        return traceparent_of(self.span)

    def streamed(self, num_tokens: int, rounds) -> None:
        now = time.perf_counter()
        for r in rounds:
            self.live.round(r.gamma, r.num_accepted, r.heat)
        if not num_tokens:
            return
        self.metrics.tokens.inc(num_tokens)
        if self.last_token_at is None:
            ttft = now - self.started
            self.metrics.ttft.observe(ttft)
            self.live.first_token(ttft)
            gaps = [0.0] * (num_tokens - 1)  # they came with the first token
        else:
            gaps = [(now - self.last_token_at) / num_tokens] * num_tokens
        for gap in gaps:  # one per token after the first, as vLLM counts them
            self.metrics.itl.observe(gap)
        self.live.tokens(num_tokens, gaps)
        self.last_token_at = now

    def migrated(self, replica: str, reason: str) -> None:
        self.metrics.migrations.inc()
        self.span.add_event("outrider.migrate", {"outrider.replica": replica,
                                                 "outrider.reason": reason})

    def finished(self, finish_reason: str, num_tokens: int, stats, replica: str,
                 num_cached_tokens: int) -> None:
        self.outcome = "OK"
        self.metrics.e2e.observe(time.perf_counter() - self.started)
        self.metrics.finished(finish_reason)
        if self.constraint:
            self.metrics.structured(self.constraint, stats.num_draft_tokens,
                                    stats.num_accepted_tokens)
        self.live.request_done()
        self.span.set_attributes({**spec_attributes(stats),
                                  "gen_ai.response.finish_reasons": [finish_reason],
                                  "gen_ai.usage.output_tokens": num_tokens,
                                  "gen_ai.usage.cache_read.input_tokens": num_cached_tokens,
                                  "outrider.replica": replica})

    def refused(self, code, message: str) -> None:
        self.outcome = code.name
        self.span.set_status(trace.StatusCode.ERROR, message)
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])

    def end(self) -> None:
        self.metrics.answered(self.outcome, self.api)
        if self.outcome == "CANCELLED":
            self.span.set_status(trace.StatusCode.ERROR, "the caller left")
        self.span.end()
