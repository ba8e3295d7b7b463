"""A client that knows nothing of Outrider but the router's address builds
its messages from server reflection and streams a generation. Only the fixture that
starts the servers uses the project; `reflection_stream` uses grpc and protobuf alone."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(llama_dir, draft_dir):
    from outrider.local_system import LocalSystemConfig, local_system

    with local_system(LocalSystemConfig(str(llama_dir), str(draft_dir), grpc_port=0)) as system:
        yield system.router


def reflection_stream(address: str, prompt: str) -> list:
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = [s for s in database.get_services() if "Generation" in s]
        assert services, database.get_services()
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName(services[0])
        method = service.methods_by_name["GenerateStream"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = request_cls(text=prompt)
        request.sampling.max_tokens = 12
        request.sampling.temperature = 0.0
        call = channel.unary_stream(f"/{service.full_name}/{method.name}",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        return list(call(request, timeout=120))


def test_a_client_built_from_reflection_alone_streams(router):
    parts = reflection_stream(router, "def add(a, b):")
    assert len(parts) >= 2
    assert parts[-1].finish_reason in ("stop", "length")
    assert sum(len(p.token_ids) for p in parts) == parts[-1].usage.completion_tokens > 0
    assert "".join(p.text for p in parts)
