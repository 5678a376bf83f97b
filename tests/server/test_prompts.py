"""Server tokenization of chat requests over documents: the pool's splitter, template errors as 400s."""

import copy
from types import SimpleNamespace

import pytest

from polykv.hf.chat import conversation_ids, conversation_tail
from polykv.pool import SharedKVPool
from polykv.server.errors import APIError
from polykv.server.prompts import chat_ids, chat_suffix_ids

from ..engine._models import tiny_model

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Gate code?"}]


@pytest.fixture(scope="module")
def state():
    model, tok = tiny_model()
    return SimpleNamespace(pool=SharedKVPool(model, tok, k="f16", v="f16"), tok=tok)


def test_chat_over_a_chat_document_is_the_conversation_tail(state):
    doc = state.pool.add_document("The gate code is PELICAN.")
    want = state.tok(conversation_tail(state.tok, MSGS), add_special_tokens=False)["input_ids"]
    assert chat_suffix_ids(state, doc, MSGS) == want
    assert chat_ids(state.tok, MSGS) == conversation_ids(state.tok, MSGS) != want


def test_template_errors_are_400_on_messages(state):
    doc = state.pool.add_document("The gate code is PELICAN.")
    tok = copy.deepcopy(state.tok)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    for call in (lambda: chat_ids(tok, MSGS), lambda: chat_suffix_ids(SimpleNamespace(pool=None, tok=tok), doc, MSGS)):
        with pytest.raises(APIError) as e:
            call()
        assert (e.value.status, e.value.param) == (400, "messages")
