"""polykv.hf.chat: the one split of a chat-templated conversation at a document's place (pool
documents, agent questions and server chat requests over a document)."""

import copy

import pytest

from polykv.errors import InvalidRequestError
from polykv.hf.chat import (ChatTemplateError, conversation_ids, conversation_tail, document_split,
                            split_at_document)


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's real tokenizer (ChatML template with a default system prompt)."""
    from transformers import AutoTokenizer

    from polykv.hf.loading import REGISTRY, _ensure_registry_cache

    return AutoTokenizer.from_pretrained(str(_ensure_registry_cache(REGISTRY["smollm2-135m"])),
                                         local_files_only=True)


DOC = "The gate code is PELICAN.\nThe ferry is called Kestrel.  \n"


def _render(tok, msgs):
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_document_prefix_plus_question_plus_tail_is_the_rendered_prompt(tok):
    prefix, tail = document_split(tok, DOC)
    q = "What is the gate code?"
    assert prefix.endswith(DOC.rstrip() + "\n\n")
    assert prefix + q + tail == _render(tok, [{"role": "user", "content": DOC.rstrip() + "\n\n" + q}])
    assert tail.endswith("<|im_start|>assistant\n") and tail.startswith("<|im_end|>")
    # an agent's prompt is prefix ids + its own ids (the pool's rule), which decode to that prompt
    ids = tok(prefix, add_special_tokens=False)["input_ids"] + tok(q + tail, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prefix + q + tail


def test_conversation_tail_continues_the_document_turn(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Gate code?"},
            {"role": "assistant", "content": "PELICAN."}, {"role": "user", "content": "And the ferry?"}]
    prefix, _ = document_split(tok, DOC)
    full = _render(tok, [{"role": "user", "content": DOC.rstrip() + "\n\nBe brief.\n\nGate code?"}] + msgs[2:])
    assert prefix + conversation_tail(tok, msgs) == full
    # a conversation that opens with the assistant gets an empty user message first
    tail = conversation_tail(tok, [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Q"}])
    assert prefix + tail == _render(tok, [{"role": "user", "content": DOC.rstrip() + "\n\n"},
                                          {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Q"}])


def test_split_at_document_cuts_right_after_the_document(tok):
    msgs = [{"role": "user", "content": "question"}]
    before, after = split_at_document(tok, msgs, "DOC ")
    assert before.endswith("DOC ") and after.startswith("question")
    assert before + after == _render(tok, [{"role": "user", "content": "DOC question"}])


def test_conversation_ids_without_a_template():
    class Plain:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    got = conversation_ids(Plain(), [{"role": "user", "content": "hi"}])
    assert got == [ord(c) for c in "user: hi\nassistant:"]


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] | lower }}{% endfor %}",  # alters the text
    "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}",  # repeats it
    "{{ raise_exception('roles must alternate') }}",  # refuses the conversation
])
def test_template_that_refuses_or_alters_is_a_typed_error(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    with pytest.raises(ChatTemplateError) as e:
        document_split(t, DOC)
    assert isinstance(e.value, InvalidRequestError)  # a 400 in the server's error table
