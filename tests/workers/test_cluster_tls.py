"""mTLS between Outrider's own processes ($OUTRIDER_CLUSTER_TLS_DIR), with a cluster CA
and certificates made by the test: router → target → draft all run over it, and a
worker refuses callers without a certificate from the cluster's CA even when they hold
the cluster token, and callers without the token even when they hold a certificate."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from outrider.client import Client
from outrider.cluster_tls import DEFAULT_NAME, TLS_DIR_ENV
from outrider.grpc_server import token_metadata
from outrider.launch import process_group
from outrider.v1 import worker_pb2 as pb
from outrider.v1 import worker_pb2_grpc

pytestmark = pytest.mark.slow
TOKEN = "cluster-tls-token"


def make_ca(directory, subject: str) -> None:
    """`directory`/ca.pem, a CA, and cert.pem + key.pem, a certificate it signed that
    names the cluster (the name internal clients check)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", f"/CN={subject}", "-keyout", "ca.key", "-out", "ca.pem")
    (directory / "san.ext").write_text(f"subjectAltName=DNS:{DEFAULT_NAME}\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=outrider-node",
            "-keyout", "key.pem", "-out", "node.csr")
    openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", "cert.pem", "-extfile", "san.ext")


@pytest.fixture(scope="module")
def cluster_pki(tmp_path_factory):
    cluster, stranger = tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("stranger")
    make_ca(cluster, "outrider-cluster-ca")
    make_ca(stranger, "someone-else-ca")
    return cluster, stranger


def load(channel: grpc.Channel, token: str | None) -> pb.Load:
    return worker_pb2_grpc.TargetStub(channel).GetLoad(
        pb.LoadRequest(), metadata=token_metadata(token), timeout=5)


def tls_channel(address: str, pki) -> grpc.Channel:
    read = [(pki / name).read_bytes() for name in ("ca.pem", "key.pem", "cert.pem")]
    credentials = grpc.ssl_channel_credentials(*read)
    return grpc.secure_channel(address, credentials,
                               options=[("grpc.ssl_target_name_override", DEFAULT_NAME)])


def test_router_target_and_draft_speak_mtls_and_workers_refuse_outsiders(
        cluster_pki, llama_dir, draft_dir, monkeypatch):
    cluster, stranger = cluster_pki
    env = {TLS_DIR_ENV: str(cluster)}
    with process_group(TOKEN, env=env) as start:
        _, draft = start("draft-worker", "--model", str(draft_dir))
        _, target = start("target-worker", "--model", str(llama_dir), "--draft-address", draft)
        _, router = start("router", "--model", str(llama_dir), "--target-address", target,
                          "--port", "0", "--no-http")
        with Client(router, timeout_s=60) as client:
            result = client.generate([5, 6, 7], max_tokens=24, temperature=0.0,
                                     ignore_eos=True, speculation="fixed", gamma_max=4)
        assert result.usage.completion_tokens == 24
        assert result.speculation.draft_tokens > 0  # the target reached the draft over mTLS

        with grpc.insecure_channel(target) as plain, pytest.raises(grpc.RpcError) as err:
            load(plain, TOKEN)  # the token alone is not enough
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(target, stranger) as other_ca, pytest.raises(grpc.RpcError) as err:
            load(other_ca, TOKEN)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(draft, cluster) as member, pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.DraftStub(member).Stats(pb.DraftStatsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # nor the certificate alone
        with tls_channel(target, cluster) as member:
            assert load(member, TOKEN).kv_total_blocks > 0
        monkeypatch.setenv(TLS_DIR_ENV, str(cluster))
        from outrider.cluster_tls import internal_channel
        with internal_channel(target) as channel:  # what routers and controllers use
            assert load(channel, TOKEN).kv_total_blocks > 0


def test_a_worker_with_an_incomplete_tls_dir_names_the_missing_file(tmp_path, draft_dir):
    (tmp_path / "ca.pem").write_text("not used")
    proc = subprocess.run([sys.executable, "-m", "outrider.cli", "draft-worker", "--model",
                           str(draft_dir), "--port", "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, TLS_DIR_ENV: str(tmp_path)})
    assert proc.returncode == 1
    assert "cert.pem" in proc.stderr and "key.pem" in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line, no traceback
