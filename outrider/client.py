"""A small client for the router's public gRPC API (protos/outrider/v1/generate.proto)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc

from outrider.v1 import generate_pb2 as gp
from outrider.v1 import generate_pb2_grpc

MODES = {"auto": gp.SPECULATION_MODE_AUTO, "off": gp.SPECULATION_MODE_OFF,
         "fixed": gp.SPECULATION_MODE_FIXED}


def build_request(prompt: str | list[int], *, max_tokens: int | None = None,
                  temperature: float | None = None, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None,
                  stop: list[str] = (), stop_token_ids: list[int] = (),
                  ignore_eos: bool = False, speculation: str = "auto", gamma_max: int = 0,
                  request_id: str = "", tag: str = "",
                  include_rounds: bool = False) -> gp.GenerateRequest:
    """A GenerateRequest; options left None take the router's defaults."""
    if speculation not in MODES:
        raise ValueError(f"speculation must be one of {sorted(MODES)}, got {speculation!r}")
    sampling = gp.SamplingOptions(stop=list(stop), stop_token_ids=list(stop_token_ids),
                                  ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = gp.GenerateRequest(sampling=sampling, request_id=request_id, tag=tag,
                             include_rounds=include_rounds,
                             speculation=gp.SpeculationOptions(mode=MODES[speculation],
                                                               gamma_max=gamma_max))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", api_key: str | None = None,
                 tls_ca: str | None = None, timeout_s: float | None = None) -> None:
        if tls_ca:
            creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self._channel = grpc.secure_channel(address, creds)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout_s = timeout_s

    def stream(self, prompt: str | list[int], **options) -> Iterator[gp.GenerateResponse]:
        """Deltas as they are generated; the last carries finish reason, usage, statistics."""
        return self._stub.GenerateStream(build_request(prompt, **options),
                                         metadata=self._metadata, timeout=self.timeout_s)

    def generate(self, prompt: str | list[int], **options) -> gp.GenerateResponse:
        return self._stub.Generate(build_request(prompt, **options), metadata=self._metadata,
                                   timeout=self.timeout_s)

    def status(self, tag: str = "") -> gp.RouterStatus:
        return self._stub.Status(gp.StatusRequest(tag=tag), metadata=self._metadata,
                                 timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
