"""The router's /metrics with its replicas' families (router/replica_metrics.py): one
replica that answers and one that does not; the page stays one valid exposition."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from outrider.router.replica_metrics import ReplicaMetrics
from prometheus_client.parser import text_string_to_metric_families

from outrider.launch import free_port
from outrider.telemetry.metrics import exposition
from outrider.v1 import state_pb2 as st
from outrider.v1 import worker_pb2 as pb

REPLICA_PAGE = """# HELP vllm:num_requests_running Sequences in the running batch
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP process_cpu_seconds_total the replica's own process
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.0
"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = REPLICA_PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Replicas:
    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports

    def live(self) -> list[st.ReplicaRecord]:
        return [st.ReplicaRecord(address=a, load=pb.Load(metrics_port=p))
                for a, p in self.ports.items()]


def test_a_replica_that_does_not_answer_is_shown_down_and_the_page_stays_valid():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        up, down = "127.0.0.1:1001", "127.0.0.1:1002"
        replicas = _Replicas({up: server.server_address[1], down: free_port()})
        body, _ = exposition(ReplicaMetrics(replicas))
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    state = {s.labels["replica"]: s.value
             for s in families["outrider_router_replica_metrics_up"].samples}
    assert state == {up: 1.0, down: 0.0}
    # (this process's own registry may hold unlabelled series of other tests' engines)
    (running,) = [s for s in families["vllm:num_requests_running"].samples
                  if "replica" in s.labels]
    assert running.labels["replica"] == up and running.value == 3.0
    # the replica's process families stay on its own port: the router's own are here once
    assert all("replica" not in s.labels for s in families["process_cpu_seconds"].samples)
    types = [line.split()[2] for line in body.decode().splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
