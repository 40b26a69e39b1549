"""OpenAI chat messages → the prompt text of the model's own chat template.

The template is the one the model ships (GGUF metadata or
``tokenizer_config.json``), rendered in ``transformers``' hardened jinja
sandbox exactly as ``apply_chat_template`` would, with the generation prompt
appended so the model answers as the assistant.
"""

from __future__ import annotations

from typing import Any

from pdd.core.errors import InvalidArgumentError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value: Any, i: int) -> str:
    field = f"messages[{i}].content"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidArgumentError(
                    f"{field}[{j}]", 'only {"type": "text", "text": ...} parts are supported'
                )
            parts.append(part["text"])
        return "".join(parts)
    if value is None:
        return ""
    raise InvalidArgumentError(field, "must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validated ``[{"role", "content"}]`` with content flattened to text."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidArgumentError(f"messages[{i}]", "must be an object with role and content")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidArgumentError(
                f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}"
            )
        out.append({"role": role, "content": _content(msg.get("content"), i)})
    return out


def render_chat(template: str, messages: Any) -> str:
    """The prompt text for ``messages`` (raises ``InvalidArgumentError`` on bad input)."""
    if not template:
        raise InvalidArgumentError(
            "messages", "the model has no chat template; use /v1/completions"
        )
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(
            [normalize_messages(messages)],
            chat_template=template,
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    except (
        jinja2.TemplateError
    ) as exc:  # NOTE: templates reject e.g. roles out of order via raise_exception
        raise InvalidArgumentError("messages", f"the chat template rejected them: {exc}") from None
    return rendered[0]
