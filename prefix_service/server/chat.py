"""Chat messages -> token ids through the model's chat template.

Rendered text is encoded with add_special_tokens=False everywhere (the template writes its own
special tokens), so a system_prompt template and a conversation that starts with the same
system message tokenize identically up to the template's end. A request on such a template:

    conversation ids = render([template's system message] + request messages, generation prompt)
    [0, len(template)) must equal the template's ids | the remainder is what the request submits
"""
from __future__ import annotations

from typing import Any, Sequence

from prefix_service.errors import InvalidRequest
from prefix_service.server.status import ChatTemplateMismatch


def render_ids(tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model's tokenizer has no chat template; send `prompt` instead of `messages`")
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises its own errors for messages a template refuses
        raise InvalidRequest(f"the model's chat template rejected the messages: {e}") from None
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def system_prompt_ids(tokenizer: Any, system_prompt: str) -> list[int]:
    """A system_prompt template: that one system message, without a generation prompt."""
    return render_ids(tokenizer, [{"role": "system", "content": system_prompt}], add_generation_prompt=False)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]], prefix_name: str | None,
                    template_ids: Sequence[int] | None, template_source: dict[str, str] | None) -> list[int]:
    """The ids a chat request submits after its template (all of them when there is none)."""
    system_prompt = (template_source or {}).get("system_prompt")
    if system_prompt is None:  # no template, or raw text that the conversation continues
        return render_ids(tokenizer, messages, add_generation_prompt=True)
    conversation = [{"role": "system", "content": system_prompt}, *messages]
    ids = render_ids(tokenizer, conversation, add_generation_prompt=True)
    n = len(template_ids or ())
    if ids[:n] != list(template_ids or ()):
        raise ChatTemplateMismatch(
            f"the model's chat template does not keep the system prompt of template {prefix_name!r} as a "
            f"token prefix of the conversation (e.g. it moves or rewrites the system message), so the "
            f"pinned KV cannot be reused; send the system message yourself without prefix_name")
    return ids[n:]
