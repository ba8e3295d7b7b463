"""Validators: Kubernetes' own strict schemas (the kubernetes-validate package, offline)
for built-in kinds; the hand-transcribed schemas in deploy/kubernetes/crd-schemas for
RayCluster, RayJob and PodMonitor, with the Kubernetes types they embed resolved to
the same strict Kubernetes schemas."""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import yaml
from referencing import Registry, Resource

from tests.deploy.objects import K8S_DIR

K8S_VERSION = "1.31.0"       # the oldest Kubernetes the manifests support
CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): "raycluster.ray.io.v1.schema.yaml",
               ("ray.io/v1", "RayJob"): "rayjob.ray.io.v1.schema.yaml",
               ("monitoring.coreos.com/v1", "PodMonitor"):
                   "podmonitor.monitoring.coreos.com.v1.schema.yaml"}


def _schema_dir(version: str) -> Path:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / \
        f"v{version}-local-strict"
    path = Path(str(folder))
    assert path.is_dir(), f"kubernetes-validate has no strict schemas for {version}"
    return path


@functools.cache
def _registry(version: str) -> Registry:
    definitions = json.loads((_schema_dir(version) / "_definitions.json").read_text())
    registry = Resource.from_contents(definitions) @ Registry()
    for name in CRD_SCHEMAS.values():
        schema = yaml.safe_load((K8S_DIR / "crd-schemas" / name).read_text())
        registry = Resource.from_contents(schema) @ registry
    return registry


@functools.cache
def _validator(api_version: str, kind: str, version: str) -> jsonschema.Validator:
    if (api_version, kind) in CRD_SCHEMAS:
        schema = yaml.safe_load(
            (K8S_DIR / "crd-schemas" / CRD_SCHEMAS[api_version, kind]).read_text())
    else:
        # kubernetes-validate's file naming: rbac.authorization.k8s.io/v1 -> rbac-v1
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        path = _schema_dir(version) / f"{kind.lower()}-{group_version}.json"
        assert path.is_file(), f"no Kubernetes {version} schema for {api_version} {kind}"
        schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(schema, registry=_registry(version))


def errors(obj: dict, version: str = K8S_VERSION) -> list[str]:
    """Every schema violation of `obj`, as 'path: message' lines (empty: valid)."""
    validator = _validator(obj["apiVersion"], obj["kind"], version)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
            for e in validator.iter_errors(obj)]
