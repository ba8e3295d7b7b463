"""A request the router will not run, on any surface: its gRPC status, why, and when to
try again (HTTP shows it as a status code, OpenAI's error body and Retry-After)."""

from __future__ import annotations

import grpc


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float = 0.0,
                 param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s
        self.param = param  # the request field at fault, when the caller knows it
