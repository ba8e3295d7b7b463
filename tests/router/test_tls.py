"""TLS on the router's public port, with a certificate made by the test."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from outrider.client import Client, Tls, UnavailableError
from outrider.launch import free_port, outrider_process
from tests.cli_utils import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_tls_router_serves_tls_clients_only(cert, llama_dir):
    cert_pem, key_pem = cert
    with outrider_process("router", "--model", str(llama_dir), "--port", "0",
                          "--tls-cert", str(cert_pem), "--tls-key", str(key_pem)) as (_, addr):
        with Client(addr, tls=Tls(ca=str(cert_pem)), timeout_s=30) as tls:
            status = tls.status()
        assert list(status.replicas) == [] and status.is_store_reachable
        with Client(addr, timeout_s=5, retry=None, wait_for_ready=False) as plain, \
             pytest.raises(UnavailableError) as err:
            plain.status()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by it."""
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", *ext)
    return d


def test_mtls_router_requires_a_client_certificate(pki, llama_dir):
    http_port = free_port()
    with outrider_process("router", "--model", str(llama_dir), "--port", "0",
                          "--http-port", str(http_port), "--tls-cert", str(pki / "server.pem"),
                          "--tls-key", str(pki / "server.key"),
                          "--tls-client-ca", str(pki / "ca.pem")) as (_, addr):
        with_cert = Tls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"),
                        key=str(pki / "client.key"))
        with Client(addr, tls=with_cert, timeout_s=30) as client:
            assert client.status().is_store_reachable
        pem = {flag: str(pki / name) for flag, name in (
            ("--tls-ca", "ca.pem"), ("--tls-cert", "client.pem"), ("--tls-key", "client.key"))}
        status = run_cli("status", "--address", addr, "--json",
                         *[x for flag_path in pem.items() for x in flag_path], timeout=60)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["isStoreReachable"] is True
        with Client(addr, tls=Tls(ca=str(pki / "ca.pem")), timeout_s=5, retry=None,
                    wait_for_ready=False) as anonymous, pytest.raises(UnavailableError):
            anonymous.status()
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        # a router without replicas: /health says 503 degraded, so the HTTPS check reads
        # /v1/models, which answers whatever the replicas
        url = f"https://127.0.0.1:{http_port}/v1/models"
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, context=context, timeout=10).read()
        context.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        models = json.loads(urllib.request.urlopen(url, context=context, timeout=10).read())
        assert [m["id"] for m in models["data"]] == [llama_dir.name]
