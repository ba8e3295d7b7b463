"""The target replicas' metrics on the router's /metrics.

A vLLM user scrapes the API's port and finds the engine's `vllm:*` families there; here
the engine runs in the target replicas, each with its own exposition. At each scrape the
router reads the live replicas' expositions (the port each reports in its Load) and
serves their families with its own (a family several hold is one family), every
replica's series labelled with its `replica` (the target's address). Each replica's
`process_*` and `python_*` families describe its own process and would collide with the
router's, so they stay on the replica's port."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

OWN_PREFIXES = ("process_", "python_")  # each process's own: left on the replica's port
SCRAPE_TIMEOUT_S = 1.0  # a replica slower than this is shown as down for this scrape


class ReplicaMetrics:
    """A collector of the live replicas' families (not registered: the router's
    exposition merges it into its own, telemetry/metrics.py exposition)."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

    def collect(self):
        urls = self._urls()
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
            texts = dict(zip(urls, pool.map(_scrape, urls.values())))
        up = GaugeMetricFamily("outrider_router_replica_metrics_up",
                               "whether the router read the replica's metrics at this "
                               "scrape (1) or not (0)", labels=["replica"])
        for replica, text in sorted(texts.items()):
            up.add_metric([replica], float(text is not None))
            for family in _families(text or ""):
                family.samples = [Sample(s.name, {**s.labels, "replica": replica}, s.value,
                                         s.timestamp, s.exemplar) for s in family.samples]
                yield family  # one per replica: the exposition merges them by name
        yield up

    def _urls(self) -> dict[str, str]:
        """replica address -> its exposition's URL, for the live replicas that serve one."""
        return {r.address: f"http://{r.address.rsplit(':', 1)[0]}:{r.load.metrics_port}/metrics"
                for r in self.replicas.live() if r.load.metrics_port}


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            return response.read().decode()
    except (OSError, ValueError):
        return None


def _families(text: str):
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:  # not an exposition (a port reused by something else)
        return []
    return [f for f in families if not f.name.startswith(OWN_PREFIXES)]
