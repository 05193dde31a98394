"""Chat templates: the model's Jinja template rendered in a sandbox, as transformers renders it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from halfbyte.errors import HalfbyteError, InvalidParameterError


class ChatTemplateError(HalfbyteError):
    """The template failed on these messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not parse ({e})") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidParameterError("messages must be a non-empty list of {role, content} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidParameterError(f"messages[{i}] must be a dict with 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages ({e})") from None
