"""The shipped demo pair served by router + target + draft processes with one API key,
and the official openai client pointed at its HTTP API (for the HTTP API test modules)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import openai

from outrider import paths
from outrider.local_system import LocalSystemConfig, local_system


@contextmanager
def demo_system(api_key: str, metrics: bool = False, target: str | None = None,
                chat_template: str | None = None):
    """metrics: /metrics on every process (`running.metrics`); target: a copy of the demo
    target to serve instead; chat_template: the router's --chat-template."""
    cfg = LocalSystemConfig(target or str(paths.demo_target_dir()), str(paths.demo_draft_dir()),
                            grpc_port=0, http_port=0, metrics=metrics,
                            extra_router_args=("--chat-template", chat_template)
                            if chat_template else ())
    with local_system(cfg, env={"OUTRIDER_API_KEYS": api_key}) as running:
        yield running


def demo_chat_template() -> str:
    """The demo target's own chat template (tokenizer_config.json's)."""
    config = paths.demo_target_dir() / "tokenizer_config.json"
    return json.loads(config.read_text())["chat_template"]


def openai_client(system, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{system.http}/v1", api_key=api_key,
                         max_retries=0, timeout=120)
