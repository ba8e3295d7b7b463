"""The rendered overlays and ways into them (pod templates, containers, ports, Ray
resources), the names the manifests share with the code, and two readers: Outrider's CLI
parser and Kubernetes label selectors."""

from __future__ import annotations

import copy
import functools
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.kustomize import build

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu")
NAMESPACE = "outrider"
OUTRIDER_IMAGE = "ghcr.io/outrider-project/outrider"
IMAGE_TAGS = {"cpu-demo": "0.1.0-cpu", "gpu": "0.1.0-cuda"}
SECRET_NAME = "outrider-secrets"
SPEC_PATH = "/etc/outrider/spec.yaml"
ENTRYPOINT = f"outrider up -f {SPEC_PATH} --address auto --wait"
REDIS_URL = "redis://outrider-redis:6379/0"


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(build(K8S_DIR / "overlays" / overlay))


def render(overlay: str) -> list[dict]:
    """The overlay's objects (a fresh copy each call)."""
    return copy.deepcopy(list(_rendered(overlay)))


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


@dataclass
class PodTemplate:
    """A pod template and where it sits (e.g. `RayCluster/outrider group=target`)."""

    where: str
    template: dict
    ray_group: str | None = None      # "headgroup" or a worker group's name
    ray_start_params: dict | None = None
    replicas: int = 1

    @property
    def labels(self) -> dict:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def containers(self) -> list[dict]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for c in self.spec["containers"]
                for p in c.get("ports", []) if "name" in p}

    def mounts(self, container: dict) -> dict[str, dict]:
        """mountPath -> the volume mounted there."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        return {m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}


def pod_templates(objects: list[dict]) -> list[PodTemplate]:
    found = []
    for o in objects:
        where = f"{o['kind']}/{o['metadata']['name']}"
        spec = o.get("spec", {})
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            found.append(PodTemplate(where, spec["template"], replicas=spec.get("replicas", 1)))
        elif o["kind"] == "RayCluster":
            head = spec["headGroupSpec"]
            found.append(PodTemplate(f"{where} head", head["template"], "headgroup",
                                     head["rayStartParams"]))
            for group in spec.get("workerGroupSpecs", []):
                found.append(PodTemplate(f"{where} group={group['groupName']}",
                                         group["template"], group["groupName"],
                                         group["rayStartParams"], group.get("replicas", 0)))
        elif o["kind"] == "RayJob" and "submitterPodTemplate" in spec:
            found.append(PodTemplate(f"{where} submitter", spec["submitterPodTemplate"]))
    return found


def ray_group(objects: list[dict], name: str) -> PodTemplate:
    (group,) = [p for p in pod_templates(objects) if p.ray_group == name]
    return group


def ray_resources(params: dict) -> dict[str, float]:
    """The Ray node resources that `ray start` gets from a group's rayStartParams."""
    resources = {"CPU": float(params.get("num-cpus", 0)),
                 "GPU": float(params.get("num-gpus", 0))}
    if "resources" in params:  # KubeRay's form: a quoted JSON object, '"{\"x\": 1}"'
        resources.update(json.loads(json.loads(params["resources"])))
    return resources


def is_outrider_container(container: dict) -> bool:
    return container["image"].split(":")[0] == OUTRIDER_IMAGE


def parse_cli(argv: list[str]):
    """argv as Outrider's own parser reads it; a clear failure when it cannot."""
    from outrider.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`outrider {shlex.join(argv)}` does not parse with outrider.cli "
                    f"(exit {exc.code}): the manifests use a command or flag the CLI lacks")


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects `labels`."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and labels.get(expr["key"]) in expr["values"]:
            return False
        if expr["operator"] == "Exists" and not present:
            return False
        if expr["operator"] == "DoesNotExist" and present:
            return False
    return True
