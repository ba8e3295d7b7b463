"""The NetworkPolicies, evaluated: who may open a connection to which pod and port.
Pods are the rendered pod templates (their labels), sources are those pods, a pod in
another namespace, Prometheus' namespace and the KubeRay operator's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.deploy.objects import (
    NAMESPACE,
    OVERLAYS,
    PodTemplate,
    pod_templates,
    render,
    selects,
)

MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
OPERATOR = {"kubernetes.io/metadata.name": "ray-system"}
ELSEWHERE = {"kubernetes.io/metadata.name": "someone-else"}
HERE = {"kubernetes.io/metadata.name": NAMESPACE}


@dataclass(frozen=True)
class Source:
    pod_labels: dict
    namespace_labels: dict


def allowed(policies: list[dict], pod: PodTemplate, port: int, source: Source) -> bool:
    """Whether `source` may connect to `pod` on TCP `port` (Kubernetes semantics: no
    policy selecting the pod allows everything; otherwise any rule of any selecting
    policy must admit the source and the port)."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], pod.labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    return any(_port_ok(rule.get("ports"), port) and _peer_ok(rule.get("from"), source)
               for policy in selecting for rule in policy["spec"].get("ingress", []))


def _port_ok(ports: list[dict] | None, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        assert p.get("protocol", "TCP") == "TCP" and isinstance(p["port"], int)
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _peer_ok(peers: list[dict] | None, source: Source) -> bool:
    if not peers:
        return True
    for peer in peers:
        assert "ipBlock" not in peer
        pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
        in_namespace = (selects(namespaces, source.namespace_labels) if namespaces is not None
                        else source.namespace_labels == HERE)
        if in_namespace and (pods is None or selects(pods, source.pod_labels)):
            return True
    return False


def _pod(pods: list[PodTemplate], component: str, group: str | None = None) -> PodTemplate:
    (pod,) = [p for p in pods if p.labels.get("app.kubernetes.io/component") == component
              and (group is None or p.ray_group == group)]
    return pod


@pytest.fixture(params=OVERLAYS)
def world(request):
    objects = render(request.param)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = pod_templates(objects)
    comp = {c: Source(_pod(pods, c, "headgroup" if c == "ray" else None).labels, HERE)
            for c in ("router", "ray", "redis", "otel-collector", "ray-submitter")}
    comp["outside"] = Source({"app": "anything"}, ELSEWHERE)
    comp["prometheus"] = Source({"app.kubernetes.io/name": "prometheus"}, MONITORING)
    comp["operator"] = Source({"app.kubernetes.io/name": "kuberay-operator"}, OPERATOR)

    def can(source: str, component: str, port: int, group: str | None = None) -> bool:
        if component == "ray":
            group = group or "headgroup"
        return allowed(policies, _pod(pods, component, group), port, comp[source])
    return can


def test_every_pod_is_behind_a_policy():
    for overlay in OVERLAYS:
        objects = render(overlay)
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        for pod in pod_templates(objects):
            assert not allowed(policies, pod, 1, Source({}, ELSEWHERE)), pod.where


def test_only_the_router_is_open_to_other_namespaces(world):
    assert world("outside", "router", 50051) and world("outside", "router", 8000)
    assert not world("outside", "router", 9400)
    for component, port in (("redis", 6379), ("ray", 6379), ("ray", 8265), ("ray", 10001),
                            ("ray", 9401), ("otel-collector", 4317)):
        assert not world("outside", component, port), (component, port)
    for group in ("target", "draft"):
        assert not world("outside", "ray", 45123, group)


def test_redis_only_from_routers_and_ray(world):
    assert world("router", "redis", 6379)
    assert world("ray", "redis", 6379)
    for source in ("otel-collector", "ray-submitter", "outside", "prometheus", "operator"):
        assert not world(source, "redis", 6379), source
    assert not world("router", "redis", 6380)


def test_ray_pods_talk_to_each_other_and_routers_reach_replicas(world):
    for group in ("headgroup", "target", "draft"):
        assert world("ray", "ray", 6379, group) and world("ray", "ray", 45123, group)
        assert world("router", "ray", 45123, group), "replicas listen on picked ports"
    assert world("ray-submitter", "ray", 8265, "headgroup")
    assert not world("ray-submitter", "ray", 6379, "headgroup")
    assert world("operator", "ray", 8265, "headgroup")
    assert not world("operator", "ray", 10001, "headgroup")


def test_prometheus_scrapes_metrics_ports_only(world):
    assert world("prometheus", "router", 9400)
    for port in range(9401, 9406):
        assert world("prometheus", "ray", port, "draft")
    assert world("prometheus", "ray", 8080, "target")
    assert world("prometheus", "otel-collector", 8889)
    assert not world("prometheus", "ray", 6379, "headgroup")
    assert not world("prometheus", "otel-collector", 4317)


def test_collector_takes_otlp_from_the_namespace(world):
    for source in ("router", "ray"):
        assert world(source, "otel-collector", 4317) and world(source, "otel-collector", 4318)
