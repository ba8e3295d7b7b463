"""Chat messages -> prompt text with the model's own Jinja chat template (from
tokenizer_config.json or chat_template.jinja), rendered in a sandbox as Hugging Face
transformers renders it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from outrider.router.validate import ValidationError


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                         ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._special = special_tokens

    @classmethod
    def from_dir(cls, model_dir: str, given: str | None = None) -> ChatTemplate | None:
        """The checkpoint's template, or None when it ships none; `given` (vLLM's
        --chat-template: a file, or the template itself) replaces it."""
        config_path = Path(model_dir, "tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template") if given is None else _template_text(given)
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        jinja_file = Path(model_dir, "chat_template.jinja")
        if source is None and jinja_file.is_file():
            source = jinja_file.read_text()
        if not source:
            return None
        special = {k: v if isinstance(v, str) else v.get("content", "")
                   for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, str | dict)}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """`extra`: a request's chat_template_kwargs (Qwen3's enable_thinking, ...): more
        variables for the template; they cannot replace the messages or the tools."""
        try:
            return self._template.render({
                **self._special, **(extra or {}), "messages": messages, "tools": tools,
                "add_generation_prompt": add_generation_prompt})
        except TemplateError as exc:
            raise ValidationError(f"messages: the chat template refused them: {exc}") from None


def _template_text(given: str) -> str:
    """--chat-template's value: a file's text, or the template itself (vLLM's rule: a
    value naming no file is taken as the template when it holds Jinja)."""
    if _is_file(Path(given)):
        return Path(given).read_text()
    if "{" not in given:
        raise ValueError(f"--chat-template {given!r}: no such file, and no Jinja template")
    return given


def _raise(message: str):
    raise TemplateError(message)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name no file system takes: a long template given inline
        return False
