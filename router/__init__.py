"""The router: the public gRPC and OpenAI HTTP APIs, authentication and validation,
replica choice by expected speculative rate, the token journal and resume, and the
state routers share (Redis)."""
