"""Shared steps of the speculative tests."""

from __future__ import annotations

from polykv import SharedKVPool
from polykv.spec.invariant import row_invariant
from tests.pool.conftest import CharTok, tiny_llama

DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps. " * 6
PROMPTS = ["abc", "the quick", "xyz brown fox", "lazy dog while", "q", "sleeps. the", "fox", "dog while the cat"]


def spec_pool(doc):
    """(model, pool, doc id): a seeded tiny Llama, a character tokenizer, K q8_0 / V turbo3, and
    `doc` added."""
    model = tiny_llama(seed=3)
    pool = SharedKVPool(model, CharTok(), k="q8_0", v="turbo3")
    return model, pool, pool.add_document(doc)


def greedy_plain_and_spec(model, pool, doc, prompts, method: str, max_new_tokens: int):
    """Greedy `generate` plain, then speculative with a fixed draft length of 4, both under
    `row_invariant(model)`: (plain answer ids, speculative answer ids, speculative stats)."""
    with row_invariant(model):
        pool.generate(doc, prompts, max_new_tokens=max_new_tokens)
        plain = pool.last_generate["answer_ids"]
        pool.generate(doc, prompts, max_new_tokens=max_new_tokens,
                      speculative={"method": method, "num_draft_tokens": 4, "adaptive": False})
    return plain, pool.last_generate["answer_ids"], pool.last_generate["speculative"]
