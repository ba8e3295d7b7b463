"""OpenTelemetry traces: one connected trace per request, client → router → target →
draft, with W3C trace context carried in gRPC metadata (and in each draft sequence's
first Propose, since one Propose serves many requests).

Spans follow the GenAI semantic conventions (gen_ai.*) plus outrider.spec.* for
speculation; rounds are span events on the target's span, not spans. Export is OTLP
(gRPC) when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set;
sampling follows OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (e.g.
parentbased_traceidratio and 0.1). Without an endpoint the API's no-op tracer costs
next to nothing."""

from __future__ import annotations

import atexit
import os
from collections.abc import Sequence

from opentelemetry import context, propagate, trace

from outrider.core.sequence import RoundStats
from outrider.core.stats import MODEL_METHOD

TRACER_NAME = "outrider"
ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def setup_tracing(service_name: str) -> bool:
    """Export this process's spans over OTLP if an endpoint is configured."""
    if not any(os.environ.get(e) for e in ENDPOINT_ENVS):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                service_name)})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_*
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flushes what is still batched
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def context_from_metadata(metadata: Sequence[tuple[str, str]] | None) -> context.Context:
    """The caller's trace context from gRPC metadata (or HTTP headers as pairs)."""
    return propagate.extract({k.lower(): v for k, v in metadata or ()})


def traced_metadata(metadata: Sequence[tuple[str, str]] = (),
                    span: trace.Span | None = None) -> tuple:
    """`metadata` plus the W3C trace context of `span` (default: the current span), or
    just `metadata` when nothing is recording."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span else None)
    return (*metadata, *carrier.items())


def traceparent_of(span: trace.Span) -> str:
    """`span`'s traceparent header value ('' when it is not recording)."""
    return dict(traced_metadata((), span)).get("traceparent", "")


def context_from_traceparent(traceparent: str) -> context.Context:
    return propagate.extract({"traceparent": traceparent})


def spec_attributes(stats) -> dict:
    """outrider.spec.* of a SpecStats (engine) — the speculation a span's request got."""
    return {"outrider.spec.draft_tokens": stats.num_draft_tokens,
            "outrider.spec.accepted_tokens": stats.num_accepted_tokens,
            "outrider.spec.rounds": stats.num_rounds,
            "outrider.spec.acceptance_rate": stats.acceptance_rate,
            "outrider.spec.mean_accepted_len": stats.mean_accepted_len,
            "outrider.spec.drafted_per_position": list(stats.drafted_per_position),
            "outrider.spec.accepted_per_position": list(stats.accepted_per_position),
            **{f"outrider.spec.{method}.{what}": totals[k]
               for method, totals in stats.by_proposer.items()
               for k, what in enumerate(("draft_tokens", "accepted_tokens"))}}


def request_attributes(model: str, params, request_id: str) -> dict:
    """gen_ai.request.* of a request's SamplingParams."""
    return {"gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
            "gen_ai.request.seed": params.seed if params.seed is not None else -1,
            "gen_ai.request.frequency_penalty": params.frequency_penalty,
            "gen_ai.request.presence_penalty": params.presence_penalty,
            "gen_ai.response.id": request_id}


def round_event(span: trace.Span, r: RoundStats) -> None:
    """A speculative round on `span`: γ proposed (the policy's decision), tokens accepted,
    the batch heat the decision was made at, the draft weights' version, how many of
    the proposals were looked up (model-free) and by which kind, what drafted the rest
    (a draft model, or a head: "eagle3", "eagle", "medusa"), a token tree's nodes (γ is
    its depth; 0: a chain), and the speculation cache's rank of the outcome its drafts
    were prepared for (0: drafted when asked)."""
    span.add_event("outrider.spec.round", {"outrider.spec.gamma": r.gamma,
                                           "outrider.spec.accepted": r.num_accepted,
                                           "outrider.spec.heat": r.heat,
                                           "outrider.draft.version": r.draft_version,
                                           "outrider.spec.free_kind": r.free_kind,
                                           "outrider.spec.num_free": r.num_free,
                                           "outrider.spec.model_method":
                                               r.model_method or MODEL_METHOD,
                                           "outrider.spec.tree_nodes": r.tree_nodes,
                                           "outrider.spec.cache_rank": r.cache_rank})
