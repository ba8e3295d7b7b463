"""Outrider's Python SDK: Client (blocking) and AsyncClient (asyncio) for the router's
public gRPC API, typed results, and exceptions by gRPC status code."""

from outrider.client.aio import AsyncClient, AsyncGenerationStream
from outrider.client.channel import Retry, Tls
from outrider.client.errors import (
    AuthenticationError,
    CancelledError,
    ConflictError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OutriderError,
    PermissionDeniedError,
    RateLimitError,
    UnavailableError,
)
from outrider.client.request import build_request
from outrider.client.results import (
    Delta,
    Generation,
    Logprob,
    Round,
    SpeculationStats,
    Timings,
    Usage,
)
from outrider.client.resume import Resume
from outrider.client.sync import Client, GenerationStream

__all__ = [
    "AsyncClient", "AsyncGenerationStream", "AuthenticationError", "CancelledError", "Client",
    "ConflictError", "DeadlineExceededError", "Delta", "Generation", "GenerationStream",
    "InternalError", "InvalidRequestError", "Logprob", "NotFoundError", "OutriderError",
    "PermissionDeniedError",
    "RateLimitError", "Resume", "Retry", "Round", "SpeculationStats", "Timings", "Tls",
    "UnavailableError", "Usage", "build_request",
]
