"""Security checks (docs/DESIGN.md §6 "internal services are not open to the world"):

- every method of the target and draft services refuses a caller without the cluster
  token (or with a wrong one) with UNAUTHENTICATED; health stays open for probes;
- secrets never reach any process's output, argv, metrics, dashboard or status: a
  router, target and draft run with OUTRIDER_API_KEYS and OUTRIDER_CLUSTER_TOKEN and
  take good and failing calls (wrong keys, wrong tokens, bad input, the CLI), then
  everything they printed up to their shutdown is searched;
- no network data is unpickled or evaluated: a static scan of the package source.

Covered elsewhere, not repeated here: API keys stored only as SHA-256 digests
(tests/router/test_router_system.py::test_keys_are_required_and_checked), server TLS and
mTLS on the router's public ports (tests/router/test_tls.py)."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from outrider.client import AuthenticationError, Client, InvalidRequestError
from outrider.grpc_server import TOKEN_METADATA_KEY
from outrider.launch import LISTENING, free_port, stop_process
from outrider.v1 import worker_pb2

API_KEY = "or-reliability-secret-key-7f3a9c"
OTHER_KEY = "or-reliability-second-key-51d2"
WRONG_KEY = "or-reliability-wrong-key-0b6e"
CLUSTER_TOKEN = "cluster-secret-token-e4d1b8"
WRONG_TOKEN = "cluster-wrong-token-93aa"
SECRETS = (API_KEY, OTHER_KEY, WRONG_KEY, CLUSTER_TOKEN, WRONG_TOKEN)
REPO = Path(__file__).resolve().parents[2]


class Captured:
    """An `outrider` process whose whole output (stdout and stderr) goes to a file."""

    def __init__(self, log: Path, *args: str, env: dict[str, str]) -> None:
        self.log = log
        self.out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "outrider.cli", *args], env=env,
                                     stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            match = LISTENING.search(log.read_text(errors="replace"))
            if match:
                self.address = match.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{args[0]} did not start:\n{log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)
        self.out.close()


@pytest.fixture(scope="module")
def secured(llama_dir, draft_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    env = dict(os.environ, OUTRIDER_CLUSTER_TOKEN=CLUSTER_TOKEN, PYTHONUNBUFFERED="1",
               OUTRIDER_API_KEYS=f"{API_KEY},{OTHER_KEY}")
    procs = {}
    try:
        procs["draft"] = Captured(logs / "draft.log", "draft-worker", "--model",
                                  str(draft_dir), env=env)
        procs["target"] = Captured(logs / "target.log", "target-worker", "--model",
                                   str(llama_dir), "--draft-address", procs["draft"].address,
                                   env=env)
        http_port = free_port()  # (just before the router binds it, not before the
        #                          workers start: another server was once given it first)
        procs["router"] = Captured(logs / "router.log", "router", "--model", str(llama_dir),
                                   "--target-address", procs["target"].address, "--port", "0",
                                   "--http-port", str(http_port), env=env)
        yield procs, f"127.0.0.1:{http_port}"
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


# -- the cluster token ---------------------------------------------------------------------------
def methods(service: str) -> list[tuple[str, bool]]:
    """(full method path, is server-streaming) of every method of a worker service."""
    desc = worker_pb2.DESCRIPTOR.services_by_name[service]
    return [(f"/{desc.full_name}/{m.name}", m.server_streaming) for m in desc.methods]


WITHOUT_TOKEN = [(), ((TOKEN_METADATA_KEY, WRONG_TOKEN),), ((TOKEN_METADATA_KEY, ""),),
                 ((TOKEN_METADATA_KEY, CLUSTER_TOKEN[:-1]),),
                 ((TOKEN_METADATA_KEY, CLUSTER_TOKEN + "x"),),
                 (("authorization", f"Bearer {CLUSTER_TOKEN}"),)]


@pytest.mark.slow
def test_workers_refuse_every_call_without_the_cluster_token(secured):
    procs, _ = secured
    refused = 0
    for role, service in (("target", "Target"), ("draft", "Draft")):
        with grpc.insecure_channel(procs[role].address) as channel:
            for path, streaming in methods(service):
                call = (channel.unary_stream if streaming else channel.unary_unary)(path)
                for metadata in WITHOUT_TOKEN:
                    with pytest.raises(grpc.RpcError) as err:
                        result = call(b"", metadata=metadata, timeout=10)
                        if streaming:
                            list(result)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (path, metadata)
                    assert CLUSTER_TOKEN not in (err.value.details() or "")
                    refused += 1
            # probes stay open; the right token is let through
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            method = "/outrider.v1.Target/GetLoad" if role == "target" \
                else "/outrider.v1.Draft/Stats"
            assert channel.unary_unary(method)(
                b"", metadata=((TOKEN_METADATA_KEY, CLUSTER_TOKEN),), timeout=10) is not None
    assert refused == len(WITHOUT_TOKEN) * (len(methods("Target")) + len(methods("Draft")))


# -- secrets in output ---------------------------------------------------------------------------
def exercise(router: str, http: str, model_dir) -> None:
    """Good and failing calls of every kind a secret rides on."""
    with Client(router, api_key=API_KEY, timeout_s=60) as client:
        # (ignore_eos: sampled with a random seed, EOS may come first, ~1 % of runs)
        assert client.generate([5, 6, 7], max_tokens=4,
                               ignore_eos=True).usage.completion_tokens == 4
        assert client.status().replicas
        with pytest.raises(InvalidRequestError):
            client.generate([5, 6, 7], top_p=3.0)
    with Client(router, api_key=OTHER_KEY, timeout_s=60) as client:
        list(client.stream("hello", max_tokens=3))
    for key in (WRONG_KEY, None, API_KEY[:-1], API_KEY.upper()):
        with Client(router, api_key=key, timeout_s=60, retry=None) as client, \
                pytest.raises(AuthenticationError):
            client.generate([5, 6, 7], max_tokens=2)
    base = f"http://{http}"
    body = {"model": Path(str(model_dir)).name, "prompt": "x", "max_tokens": 2}
    for key, status in ((API_KEY, 200), (WRONG_KEY, 401), ("", 401), (API_KEY[1:], 401)):
        response = requests.post(f"{base}/v1/completions", json=body, timeout=60,
                                 headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == status
    requests.post(f"{base}/v1/completions", json={"model": "x", "top_p": 9, "api_key": API_KEY},
                  headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    requests.get(f"{base}/v1/models", headers={"Authorization": f"Basic {WRONG_KEY}"},
                 timeout=60)


def cli(*args: str, key: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUTRIDER_API_KEY=key)
    return subprocess.run([sys.executable, "-m", "outrider.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_secrets_never_appear_in_output_argv_metrics_or_status(secured, llama_dir):
    procs, http = secured
    router, target = procs["router"].address, procs["target"].address
    exercise(router, http, llama_dir)
    # a worker call with a wrong token
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError):
        channel.unary_unary("/outrider.v1.Target/GetLoad")(
            b"", metadata=((TOKEN_METADATA_KEY, WRONG_TOKEN),), timeout=10)
    seen = {}
    # the CLI, succeeding and failing, with and without --debug
    for key in (API_KEY, WRONG_KEY):
        for debug in ((), ("--debug",)):
            done = cli(*debug, "generate", "--address", router, "--max-tokens", "2",
                       "--json", "hello", key=key)
            seen[f"cli generate {key[-4:]} {debug}"] = done.stdout + done.stderr
            assert (done.returncode == 0) == (key == API_KEY), done.stderr
            assert ("token_ids" in done.stdout) if key == API_KEY else \
                ("UNAUTHENTICATED" in done.stderr)
    done = cli("status", "--address", router, "--json", key=API_KEY)
    seen["cli status"] = done.stdout + done.stderr
    # what the processes expose
    seen["router /metrics"] = requests.get(f"http://{http}/metrics", timeout=30).text
    seen["router /dashboard/data"] = requests.get(f"http://{http}/dashboard/data",
                                                  timeout=30).text
    with Client(router, api_key=API_KEY, timeout_s=30) as client:
        seen["router Status"] = str(client.status())
    for name, p in procs.items():
        seen[f"{name} argv"] = Path(f"/proc/{p.proc.pid}/cmdline").read_bytes().decode()
    # every line they printed, through a clean shutdown
    for name, p in reversed(list(procs.items())):
        p.stop()
        seen[f"{name} output"] = p.log.read_text(errors="replace")
    assert seen["router output"] and "router listening" in seen["router output"]
    leaks = {(where, secret) for where, text in seen.items() for secret in SECRETS
             if secret in text}
    # a digest of a secret is as good as the secret for matching: not printed either
    digests = {hashlib.sha256(s.encode()).hexdigest() for s in SECRETS}
    leaks |= {(where, "sha256") for where, text in seen.items() for d in digests if d in text}
    assert leaks == set()


# -- no pickle or eval of network data ------------------------------------------------------------
PACKAGES = ("outrider", "router", "target_worker", "draft_worker", "cluster")
SKIP = re.compile(r"outrider/v1/.*_pb2(_grpc)?\.py$")  # generated by protoc


def _is_true(call: ast.Call, arg: str) -> bool:
    return any(k.arg == arg and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def _loader(call: ast.Call) -> str | None:
    return next((ast.unparse(k.value) for k in call.keywords if k.arg == "Loader"), None)


# (owner module or "" for a bare name, function names, is it unsafe given the call)
UNSAFE = [
    (("pickle", "cPickle", "marshal", "dill", "cloudpickle", "shelve"),
     ("load", "loads", "open", "Unpickler"), lambda call: True),
    (("",), ("eval", "exec", "compile", "__import__"), lambda call: True),
    (("yaml",), ("unsafe_load", "full_load", "load_all"), lambda call: True),
    (("yaml",), ("load",), lambda call: "Safe" not in (_loader(call) or "")),
    (("torch",), ("load",), lambda call: not _is_true(call, "weights_only")),
    (("np", "numpy"), ("load",), lambda call: _is_true(call, "allow_pickle")),
    (("subprocess",), ("run", "Popen", "call", "check_output", "check_call"),
     lambda call: _is_true(call, "shell")),
]


def unsafe_calls(source: str) -> list[str]:
    """Calls that execute or unpickle data: pickle/marshal/dill/cloudpickle loads,
    eval/exec/compile, yaml.load without a safe loader, unsafe_load, torch.load without
    weights_only=True, numpy load with allow_pickle=True, shell=True subprocesses."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            owner, name = "", func.id
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, name = func.value.id, func.attr
        else:
            continue
        if any(owner in owners and name in names and is_unsafe(node)
               for owners, names, is_unsafe in UNSAFE):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_scan_finds_what_it_looks_for():
    bad = ("import pickle, yaml, torch, numpy as np, subprocess\n"
           "pickle.loads(b)\neval(s)\nexec(s)\nyaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\n"
           "torch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\n"
           "subprocess.run(c, shell=True)\n")
    good = ("import yaml, torch\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n"
            "torch.load(f, weights_only=True)\nmodel.eval()\nre.compile(p)\n")
    assert len(unsafe_calls(bad)) == 9
    assert unsafe_calls(good) == []


def test_no_package_code_unpickles_or_evaluates_data():
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))
             if not SKIP.search(p.as_posix())]
    assert len(files) > 40  # the scan really looked at the package
    found = {str(p.relative_to(REPO)): calls for p in files
             if (calls := unsafe_calls(p.read_text()))}
    assert found == {}
