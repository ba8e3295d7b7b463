"""Traces, metrics and dashboards against a live system (router, target and draft
processes on the demo pair): a real OTLP receiver, a real Prometheus server, headless
Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outrider import paths
from outrider.client import Client, InvalidRequestError
from outrider.core.policy import EPOCH_STEPS
from outrider.launch import free_port
from outrider.local_system import LocalSystemConfig, local_system
from tests.scraping import scrape, total

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).parents[2] / "deploy" / "dashboards" / "outrider.json"
PROMPT = "def fibonacci(n):\n"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on loopback: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans += [(attrs.get("service.name", ""), s) for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver():
    sink = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(0)


@pytest.fixture(scope="module")
def system(receiver):
    _, port = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    cfg = LocalSystemConfig(str(paths.demo_target_dir()), str(paths.demo_draft_dir()),
                            grpc_port=0, http_port=0, metrics=True, speculation_cache=True)
    with local_system(cfg, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def client_tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider.get_tracer("test-client"), exporter


def test_one_connected_trace_per_request_with_acceptance(system, receiver, client_tracer):
    sink, _ = receiver
    tracer, _ = client_tracer
    with tracer.start_as_current_span("client call") as root, \
         Client(system.router, timeout_s=120) as client:
        result = client.generate(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True,
                                 speculation="fixed", gamma_max=4)
    trace_id = root.get_span_context().trace_id.to_bytes(16, "big")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = sink.of_trace(trace_id)
        if {svc for svc, _ in spans} >= {"outrider-router", "outrider-target", "outrider-draft"}:
            break
        time.sleep(0.2)
    by_service = {svc: s for svc, s in spans}
    router, target, draft = (by_service[f"outrider-{n}"] for n in ("router", "target", "draft"))
    # connected: client -> router -> target -> draft
    assert router.parent_span_id == root.get_span_context().span_id.to_bytes(8, "big")
    assert target.parent_span_id == router.span_id
    assert draft.parent_span_id == target.span_id
    attrs = {a.key: a.value for a in router.attributes}
    s = result.speculation
    assert attrs["outrider.spec.draft_tokens"].int_value == s.draft_tokens
    assert attrs["outrider.spec.accepted_tokens"].int_value == s.accepted_tokens
    assert attrs["outrider.spec.rounds"].int_value == s.rounds
    assert attrs["outrider.spec.acceptance_rate"].double_value == pytest.approx(s.acceptance_rate)
    assert attrs["outrider.spec.mean_accepted_len"].double_value == pytest.approx(
        s.mean_accepted_len)
    per_pos = [v.int_value for v in attrs["outrider.spec.accepted_per_position"].array_value.values]
    assert per_pos == list(s.accepted_per_position)
    assert attrs["gen_ai.usage.output_tokens"].int_value == 40
    assert attrs["gen_ai.request.model"].string_value == "demo-target"
    cached = result.usage.cached_prompt_tokens  # as the target and the router saw it
    assert attrs["gen_ai.usage.cache_read.input_tokens"].int_value == cached
    target_attrs = {a.key: a.value for a in target.attributes}
    assert target_attrs["gen_ai.usage.cache_read.input_tokens"].int_value == cached
    rounds = [{a.key: a.value for a in e.attributes} for e in target.events
              if e.name == "outrider.spec.round"]
    assert len(rounds) == s.rounds  # every round an event on the target's span ...
    assert sum(r["outrider.spec.gamma"].int_value for r in rounds) == s.draft_tokens
    assert sum(r["outrider.spec.accepted"].int_value for r in rounds) == s.accepted_tokens
    assert all(r["outrider.spec.heat"].double_value >= 0 for r in rounds)
    assert {r["outrider.spec.model_method"].string_value for r in rounds} == {"draft_model"}
    assert all(r["outrider.spec.tree_nodes"].int_value == 0 for r in rounds)  # chains
    assert len(spans) == 3  # ... not a span: one span per process


def test_metrics_move_by_exactly_the_requests_statistics(system):
    target, router = system.metrics["target"], system.metrics["router"]
    before_t, before_r = scrape(target), scrape(router)
    with Client(system.router, timeout_s=120) as client:
        result = client.generate(PROMPT, max_tokens=33, temperature=0.0, ignore_eos=True,
                                 speculation="fixed", gamma_max=3, include_rounds=True)
        with pytest.raises(InvalidRequestError):
            client.generate(PROMPT, top_p=2.0)
    after_t, after_r = scrape(target), scrape(router)

    def moved(before, after, name, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)
    s = result.speculation
    assert moved(before_t, after_t, "vllm:spec_decode_num_drafts_total") == sum(
        1 for r in result.rounds if r.gamma)
    assert moved(before_t, after_t, "vllm:spec_decode_num_draft_tokens_total") == s.draft_tokens
    assert moved(before_t, after_t, "vllm:spec_decode_num_accepted_tokens_total") == (
        s.accepted_tokens)
    assert sum(drafted for drafted, _ in s.by_proposer.values()) == s.draft_tokens
    for method, (drafted, accepted) in s.by_proposer.items():  # per proposer (§2.8)
        assert moved(before_t, after_t, "vllm:spec_decode_num_draft_tokens_total",
                     method=method) == drafted
        assert moved(before_t, after_t, "vllm:spec_decode_num_accepted_tokens_total",
                     method=method) == accepted
    for p, accepted in enumerate(s.accepted_per_position):
        assert moved(before_t, after_t, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(p)) == accepted
        assert moved(before_t, after_t, "outrider_spec_drafted_tokens_per_pos_total",
                     position=str(p)) == s.drafted_per_position[p]
    assert moved(before_t, after_t, "vllm:generation_tokens_total") == 33
    assert moved(before_t, after_t, "outrider_spec_gamma_count") == s.rounds
    assert moved(before_r, after_r, "outrider_router_generation_tokens_total") == 33
    assert moved(before_r, after_r, "vllm:time_to_first_token_seconds_count") == 1
    assert moved(before_r, after_r, "vllm:inter_token_latency_seconds_count") == 32
    assert moved(before_r, after_r, "vllm:e2e_request_latency_seconds_count") == 1
    assert moved(before_r, after_r, "outrider_requests_total", code="OK") == 1
    assert moved(before_r, after_r, "outrider_requests_total", code="INVALID_ARGUMENT") == 1
    assert moved(before_r, after_r, "vllm:request_success_total", finished_reason="length") == 1
    # the engine thread's steps: each round was one, its time on CPU and waits within them
    wall, cpu, waited = (moved(before_t, after_t, "outrider_engine_step_seconds_total",
                               part=part) for part in ("wall", "cpu", "proposer_wait"))
    assert moved(before_t, after_t, "outrider_engine_steps_total") >= s.rounds
    assert 0 < cpu <= wall and 0 < waited < wall, (wall, cpu, waited)
    assert total(after_t, "outrider_engine_context_switches", kind="voluntary") > 0


def test_the_referee_shows_what_it_measured_per_load(system):
    """An AUTO stream alone runs at least one epoch at load 1: the page shows the
    goodput the referee measured for the arm it ran, and the arm it runs now."""
    with Client(system.router, timeout_s=120) as client:
        client.generate(PROMPT, max_tokens=3 * EPOCH_STEPS, temperature=0.7, top_p=0.9,
                        ignore_eos=True, speculation="auto", gamma_max=1)
    after = scrape(system.metrics["target"])
    measured = [v for (n, ls), v in after.items()
                if n == "outrider_referee_goodput_tokens_per_second" and dict(ls)["load"] == "1"]
    assert measured and all(v > 0 for v in measured), measured
    assert total(after, "outrider_referee_speculates", load="1") in (0.0, 1.0)


@pytest.fixture(scope="module")
def prometheus(system, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make test installs it)"
    d = tmp_path_factory.mktemp("prometheus")
    targets = [*system.metrics.values(), system.http]
    (d / "prometheus.yml").write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "outrider", "static_configs": [{"targets": targets}]}]}))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def prom_api(base: str, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{base}/api/v1/{path}", timeout=10).read())


def test_prometheus_scrapes_router_and_workers(prometheus):
    base, targets = prometheus
    deadline = time.monotonic() + 60
    health = {}
    while time.monotonic() < deadline:
        try:
            active = prom_api(base, "targets")["data"]["activeTargets"]
            health = {t["labels"]["instance"]: t["health"] for t in active}
            if len(health) == len(targets) and set(health.values()) == {"up"}:
                break
        except OSError:
            pass
        time.sleep(0.5)
    assert health == {t: "up" for t in targets}


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in board["panels"] for t in panel.get("targets", ())
            if t.get("datasource", {}).get("type") == "prometheus"]


# label matchers, strings, ranges and numbers: what is left are names
NOT_NAMES = re.compile(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|(?<![\w:])\d+\.?\d*')
IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
PROMQL_WORDS = {"sum", "by", "rate", "max", "min", "avg", "histogram_quantile", "scalar",
                "without", "le", "position", "speculated", "code", "api", "model_name",
                "draft_version", "method", "accepted", "or"}


def test_every_dashboard_query_names_exported_metrics_and_answers(system, prometheus):
    base, _ = prometheus
    with Client(system.router, timeout_s=120) as client:  # traffic over a few scrapes
        for _ in range(4):
            client.generate(PROMPT, max_tokens=24, temperature=0.0, speculation="auto")
            time.sleep(1.0)
        # streams enough for the speculation cache to prepare (it does not beside
        # drafting ahead) and the draft model drafting: its panel's series
        client.generate_batch([f"{PROMPT}    # case {i}\n" for i in range(4)], max_tokens=48,
                              temperature=0.0, speculation="fixed", gamma_max=4,
                              proposer="model", max_concurrency=4)
    exported = {name for address in [*system.metrics.values(), system.http]
                for name, _ in scrape(address)}
    queries = dashboard_queries()
    assert len(queries) >= 20
    time.sleep(3)  # a few more scrapes: rates need two samples
    for expr in queries:
        names = set(IDENTIFIER.findall(NOT_NAMES.sub(" ", expr)))
        unknown = names - PROMQL_WORDS - exported
        assert not unknown, f"{expr}: {unknown} not exported"
        query = expr.replace("$__rate_interval", "1m").replace('=~"$model"', '=~".+"')
        answer = prom_api(base, "query?query=" + urllib.request.quote(query))
        assert answer["status"] == "success" and answer["data"]["result"], expr


def test_live_page_renders_charts_in_headless_chromium(system, tmp_path):
    with Client(system.router, timeout_s=120) as client:
        client.generate_batch([PROMPT, "import os\n", "class Stack:\n"], max_tokens=24,
                              temperature=0.0, speculation="auto")
    time.sleep(2.5)  # two samples of the live series
    url = f"http://{system.http}/dashboard"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed (make test installs it)"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000", "--window-size=1400,1000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    points = dict(re.findall(r'<canvas id="(\w+)"[^>]*data-points="(\d+)"', dom))
    assert set(points) == {"throughput", "acceptance", "accepted_len", "per_position",
                           "gamma_heat", "latency"}
    assert all(int(n) > 0 for n in points.values()), points
    shot = tmp_path / "dashboard.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)  # [height, width, channels] in [0, 1]
    colourful = (pixels[..., :3].max(axis=-1) - pixels[..., :3].min(axis=-1)) > 0.3
    assert pixels.shape[0] >= 900 and colourful.sum() > 2000  # the charts' coloured lines
