"""Real SmolLM2 checks (marker `model`): agent isolation over a shared compressed document."""

import pytest
import torch

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol():
    from polykv.hf.loading import load_model

    torch.set_num_threads(1)
    return load_model()


DOC = ("Harbour log, week 12. The ferry Kestrel ran on time every day. The new harbour master took "
       "office on Monday. The secret code word for the harbour gate is PELICAN. Fishing boats stayed "
       "in port on Thursday because of the storm. The lighthouse lamp was replaced on Friday.")


def test_agents_recall_shared_doc_and_only_their_own_fact(smol):
    from polykv.pool import SharedKVPool

    model, tok = smol
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3")
    doc = pool.add_document(DOC, name="log")
    ask = ("Also note: my boat is called {}.\n\nWhat is the secret code word for the harbour gate? "
           "Then tell me the name of my boat.")
    prompts = [ask.format("Bluebell"), ask.format("Starling")]
    a, b = pool.generate(doc, prompts, max_new_tokens=40)
    assert "pelican" in a.lower() and "pelican" in b.lower(), (a, b)
    assert "bluebell" in a.lower() and "starling" not in a.lower(), a
    assert "starling" in b.lower() and "bluebell" not in b.lower(), b
    # the prefix is a stable token prefix of each agent's full chat prompt
    full = tok.apply_chat_template([{"role": "user", "content": DOC + "\n\n" + prompts[0]}],
                                   tokenize=False, add_generation_prompt=True)
    d = pool._docs[doc]
    assert tok.decode(d.ids + pool.prompt_ids(doc, prompts[0])) == full
