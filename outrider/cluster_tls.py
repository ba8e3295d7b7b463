"""Mutual TLS between Outrider's own processes: router → target, target → draft,
controller → target (docs/DESIGN.md §6: workers require the cluster token, or mTLS; with this on,
both).

Off unless $OUTRIDER_CLUSTER_TLS_DIR names a directory holding `ca.pem`, `cert.pem` and
`key.pem`, the same on every process of the cluster or each with its own certificate
signed by the one CA. Worker servers then require a client certificate signed by that CA,
and every internal call presents one and checks the server's. Certificates name the
cluster, not a host, since replicas move between addresses: each must carry the DNS
name $OUTRIDER_CLUSTER_TLS_NAME (default `outrider-internal`), which clients check in
place of the address they dial."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import grpc

TLS_DIR_ENV = "OUTRIDER_CLUSTER_TLS_DIR"
TLS_NAME_ENV = "OUTRIDER_CLUSTER_TLS_NAME"
DEFAULT_NAME = "outrider-internal"


def _files() -> tuple[bytes, bytes, bytes] | None:
    """(CA, certificate, key) PEM bytes, or None when cluster TLS is off."""
    directory = os.environ.get(TLS_DIR_ENV)
    if not directory:
        return None
    paths = [Path(directory) / name for name in ("ca.pem", "cert.pem", "key.pem")]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"${TLS_DIR_ENV} is set but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} missing")
    ca, cert, key = (p.read_bytes() for p in paths)
    return ca, cert, key


def server_credentials() -> grpc.ServerCredentials | None:
    """For a worker's server: its certificate, and client certificates required."""
    files = _files()
    if files is None:
        return None
    ca, cert, key = files
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=True)


# reconnect quickly to a restarted process (gRPC's default backoff grows to 2 minutes)
QUICK_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000))


def internal_channel(address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to another Outrider process: mTLS when configured, plaintext otherwise."""
    files = _files()
    if files is None:
        return grpc.insecure_channel(address, options=list(options))
    ca, cert, key = files
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                               certificate_chain=cert)
    name = os.environ.get(TLS_NAME_ENV) or DEFAULT_NAME
    return grpc.secure_channel(address, credentials,
                               options=[*options, ("grpc.ssl_target_name_override", name)])
