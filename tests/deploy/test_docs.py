"""docs/KUBERNETES.md says what the manifests do: its paths exist, its commands use the
names, ports, keys and versions the manifests and the code use."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from tests.deploy.objects import ENTRYPOINT, K8S_DIR, ROOT, find, parse_cli, render

DOC = ROOT / "docs" / "KUBERNETES.md"


def test_paths_in_the_doc_exist():
    text = DOC.read_text()
    for path in set(re.findall(r"deploy/kubernetes/[\w./-]+\w", text)):
        assert (ROOT / path).exists(), path
    for path in set(re.findall(r"`((?:base|overlays|components|crd-schemas)/[\w./-]*)`", text)):
        assert (K8S_DIR / path).exists(), path


def test_commands_match_the_manifests():
    text = DOC.read_text()
    assert ENTRYPOINT in text
    template = yaml.safe_load((K8S_DIR / "base" / "secret.example.yaml").read_text())
    keys = set(re.findall(r"--from-literal=(\w+)=", text))
    assert keys == set(template["stringData"])
    assert "secret generic outrider-secrets" in text

    objects = render("cpu-demo")
    args = parse_cli(find(objects, "Deployment", "outrider-router")
                     ["spec"]["template"]["spec"]["containers"][0]["args"])
    assert f"svc/outrider-router {args.port}:{args.port} {args.http_port}:{args.http_port}" \
        in text
    assert f'"model": "{Path(args.model).name}"' in text
    assert f"--address 127.0.0.1:{args.port}" in text


def test_cli_commands_in_the_doc_parse():
    text = re.sub(r"\\\n\s*", " ", DOC.read_text())
    commands = re.findall(r"(?:^|\s|=\S+ )outrider ((?:generate|status|keys)[^\n`]*)", text)
    assert len(commands) >= 3
    for command in commands:
        parse_cli(shlex.split(command.replace("NAME", "alice")))


def test_kuberay_chart_version_is_the_one_the_schemas_name():
    text = DOC.read_text()
    (version,) = set(re.findall(r"kuberay/kuberay-operator --version (\S+)", text))
    assert f"`kuberay-operator` {version}" in (K8S_DIR / "crd-schemas" / "README.md").read_text()
