"""Generated protobuf/gRPC stubs (`make protos`); the sources are in protos/outrider/v1."""
