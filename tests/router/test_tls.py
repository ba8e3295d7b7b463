"""TLS on the router's public port, with a certificate made by the test."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from outrider.client import Client, Tls, UnavailableError
from outrider.launch import outrider_process

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
