"""gRPC status codes as Python exceptions a caller can catch by meaning."""

from __future__ import annotations

import grpc


class OutriderError(Exception):
    """A call the router refused or could not finish. `code` is the gRPC status;
    `retry_after_s` is the router's hint for when trying again may work (0: none)."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
                 retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.message, self.code, self.retry_after_s = message, code, retry_after_s

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidRequestError(OutriderError):
    """An argument was refused; the message names the field."""


class AuthenticationError(OutriderError):
    """No API key, or one the router does not know."""


class PermissionDeniedError(OutriderError):
    """The key is disabled or may not use the request's tag."""


class NotFoundError(OutriderError):
    """The request names a model the router does not serve; the message lists those it does."""


class RateLimitError(OutriderError):
    """The key's rate limit or every replica's queue is full; see retry_after_s."""


class ConflictError(OutriderError):
    """The request id is running, or was used for a different request."""


class UnavailableError(OutriderError):
    """No router or no target replica could be reached (after the retries)."""


class DeadlineExceededError(OutriderError):
    """The call's deadline (timeout_s) passed first."""


class CancelledError(OutriderError):
    """The call was cancelled."""


class InternalError(OutriderError):
    """The router or a replica failed in a way the caller cannot fix."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def from_rpc_error(exc: grpc.RpcError) -> OutriderError:
    """The exception for a failed call (sync or asyncio), with the router's retry hint."""
    code, details = exc.code(), exc.details() or ""
    trailers = dict(exc.trailing_metadata() or ())
    try:
        retry_after_s = int(trailers.get("retry-after-ms", 0)) / 1000
    except (TypeError, ValueError):
        retry_after_s = 0.0
    return _BY_CODE.get(code, InternalError)(details or code.name, code, retry_after_s)
