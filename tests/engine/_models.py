"""Test models: a tiny random Llama with SmolLM2's real tokenizer, and the real SmolLM2."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def real_model():
    from polykv.hf.loading import load_model

    return load_model()  # the embedded model is installed by `make test`: a failure here is real


@functools.lru_cache(maxsize=1)
def tiny_model():
    """2-layer random Llama (head_dim 64, GQA 2:1) over SmolLM2's tokenizer (49152 tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = real_model()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    return model, tok


def make_pool(model, tok, **kw):
    """The shared compressed pool when it is there, else the dense reference pool."""
    try:
        from polykv.pool import SharedKVPool  # noqa: F401
    except ImportError:
        SharedKVPool = None
    if SharedKVPool is not None:
        return SharedKVPool(model, tok, k=kw.pop("k", "q8_0"), v=kw.pop("v", "turbo3"), **kw)
    from polykv.engine.dense import DensePool

    return DensePool(model, tok, **kw)


def shared_pool():
    """(model, tok, pool) over the tiny model; skips the calling test when the pool is the dense
    reference one (no `generate`: the batched-agent paths are not there)."""
    import pytest

    model, tok = tiny_model()
    pool = make_pool(model, tok)
    if not hasattr(pool, "generate"):
        pytest.skip("needs the shared pool (AgentBatch)")
    return model, tok, pool
