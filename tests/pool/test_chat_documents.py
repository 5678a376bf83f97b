"""Chat documents in the pool: the document opens the first user turn; questions and whole
conversations over it are cut by the one splitter (`polykv.hf.chat`)."""

import pytest

from polykv.hf.chat import conversation_ids, conversation_tail
from polykv.pool import SharedKVPool

from ..engine._models import tiny_model

DOC = "The gate code is PELICAN. The ferry is called Kestrel."
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Gate code?"},
        {"role": "assistant", "content": "PELICAN."}, {"role": "user", "content": "And the ferry?"}]


@pytest.fixture(scope="module")
def pool():
    model, tok = tiny_model()  # SmolLM2's real tokenizer (ChatML template) over a tiny random model
    return SharedKVPool(model, tok, k="f16", v="f16")


def _render(tok, msgs):
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_question_and_conversation_over_a_chat_document(pool):
    tok = pool.tok
    doc = pool.add_document(DOC)
    ids = pool._docs[doc].ids
    q = "What is the gate code?"
    assert tok.decode(ids + pool.prompt_ids(doc, q)) == _render(tok, [{"role": "user", "content": DOC + "\n\n" + q}])
    got = pool.prompt_ids(doc, MSGS)
    assert got == tok(conversation_tail(tok, MSGS), add_special_tokens=False)["input_ids"]
    # system folded into the first user turn, right after the document
    want = _render(tok, [{"role": "user", "content": DOC + "\n\nBe brief.\n\nGate code?"}] + MSGS[2:])
    assert tok.decode(ids + got) == want


def test_conversation_over_a_token_document_is_the_whole_rendering(pool):
    doc = pool.add_document([5, 6, 7, 8])
    assert pool.prompt_ids(doc, MSGS) == conversation_ids(pool.tok, MSGS)
    assert pool.prompt_ids(doc, [9, 10]) == [9, 10]
