"""Chat messages -> token ids (server/chat.py) on the tiny tokenizer under chat templates of its
own: the errors a request sees when the tokenizer has no chat template or its template refuses
the messages, no special tokens beyond the ones the chat template writes, and a system_prompt
template whose prefix plus the request's ids is the whole conversation."""
from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from prefix_service.errors import InvalidRequest
from prefix_service.synthetic import CHATML
from prefix_service.server.chat import chat_prompt_ids, render_ids, system_prompt_ids

USER = [{"role": "user", "content": "cancel my order"}]
# writes a default system message when the conversation starts without one (as Qwen2.5's does)
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant."
                  "<|im_end|>\n' }}{% endif %}" + CHATML)


@pytest.fixture
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_a_tokenizer_without_a_chat_template_asks_for_a_prompt_instead(tok):
    tok.chat_template = None
    with pytest.raises(InvalidRequest, match="has no chat template; send `prompt` instead of `messages`"):
        render_ids(tok, USER, add_generation_prompt=True)


def test_messages_the_chat_template_refuses_are_an_invalid_request_quoting_its_error(tok):
    tok.chat_template = ("{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last message must be the "
                         "user\\'s') }}{% endif %}" + CHATML)
    with pytest.raises(InvalidRequest, match="chat template rejected the messages: the last message must be the user"):
        render_ids(tok, [{"role": "assistant", "content": "hi"}], add_generation_prompt=True)
    assert render_ids(tok, USER, add_generation_prompt=True)  # a conversation it accepts renders


def test_a_tokenizer_that_adds_a_bos_token_adds_none_to_a_chat_template_that_writes_its_own(tok):
    """The rendered text is encoded without the tokenizer's special tokens: one BOS, the template's."""
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                    bos)])
    assert tok.encode("the order")[0] == bos  # the tokenizer adds it when asked to
    tok.chat_template = "{{ bos_token }}" + CHATML
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    ids = render_ids(tok, USER, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == bos and ids[1] != bos


@pytest.mark.parametrize("system_prompt", ["", "You classify the intent of the user."])
def test_a_system_prompt_template_and_the_requests_ids_make_the_whole_conversation(tok, system_prompt):
    """Also for an empty system prompt, where the template writes a default system message when the
    conversation starts without one: the request continues the template's (empty) system message."""
    tok.chat_template = DEFAULT_SYSTEM
    template = system_prompt_ids(tok, system_prompt)
    rest = chat_prompt_ids(tok, USER, "sys", template, {"system_prompt": system_prompt})
    whole = render_ids(tok, [{"role": "system", "content": system_prompt}, *USER], add_generation_prompt=True)
    assert template + rest == whole
    assert "helpful assistant" not in tok.decode(template + rest)
    # a content template is continued by the whole conversation, the default system message too
    assert chat_prompt_ids(tok, USER, "doc", [5, 6], {"content": "x"}) == render_ids(tok, USER,
                                                                                     add_generation_prompt=True)
