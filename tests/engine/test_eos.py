"""One EOS rule (`polykv.generation.stop_token_ids`) for `SharedKVPool.generate` and the engine: both
stop at a chat end-of-turn marker that neither the tokenizer nor the model config names as eos."""

import pytest
import torch

from polykv.engine import Engine, GenerationRequest, SamplingParams
from polykv.pool import SharedKVPool


class MarkerTok:
    """One id per character (ids 3..); optionally an "<end_of_turn>" marker in the vocabulary."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def __init__(self, marker: int | None = None):
        self.marker = marker

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + (ord(c) % 120) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i % 26)) for i in ids if i > 2 and i != self.marker)

    def get_vocab(self):
        return {} if self.marker is None else {"<end_of_turn>": self.marker}


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


DOC, Q, N = list(range(3, 60)), [70, 71, 72], 24


def _pool(model, tok):
    pool = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=32)
    return pool, pool.add_document(DOC)


def _engine(pool, doc, ignore_eos):
    """(text, finish reason, completion tokens) of one greedy engine request over `doc`."""
    with Engine(pool) as eng:
        h = eng.submit(GenerationRequest(Q, SamplingParams(max_tokens=N, temperature=0, ignore_eos=ignore_eos),
                                         document=doc))
        text, reason, usage = h.result_sync(timeout=60)
    return text, reason, usage["completion_tokens"]


def test_pool_and_engine_stop_at_the_end_of_turn_marker(model):
    pool, doc = _pool(model, MarkerTok())
    pool.generate(doc, [Q], max_new_tokens=N)
    free = pool.last_generate["answer_ids"][0]
    assert len(free) == N  # nothing stops it: no eos anywhere
    # the marker: the first token, from the third on, that the free run has not produced before
    j = next(i for i in range(2, N) if free[i] not in free[:i])
    pool, doc = _pool(model, MarkerTok(marker=free[j]))
    pool.generate(doc, [Q], max_new_tokens=N)
    assert pool.last_generate["answer_ids"][0] == free[:j]
    tok = pool.tok
    assert _engine(pool, doc, ignore_eos=False) == (tok.decode(free[:j]), "stop", j + 1)  # the marker counts
    assert _engine(pool, doc, ignore_eos=True) == (tok.decode(free), "length", N)
