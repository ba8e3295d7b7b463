"""Reading a process's /metrics page in tests (parsed by prometheus_client)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics page."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))
