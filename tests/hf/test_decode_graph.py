"""DecodeGraph's static step (what a CUDA graph captures) run eagerly on CPU: writes at device
positions, attention over the reserved capacity with device lengths, host lengths advanced after
the step. It must match plain KVCache decoding on the same model and packed data."""

import pytest
import torch

from polykv.hf import DecodeGraph, KVCache

from ..pool.conftest import tiny_llama


def decode_static_beside_plain(model, plain: list, static, ids: torch.Tensor, steps: torch.Tensor):
    """Prefill each batch-1 cache of `plain` with its row of ids [B, T] and `static` with all B,
    then decode steps [n, B, 1]: DecodeGraph's static step (capture=False) must equal the plain
    caches' steps at every step. Returns the runner (its n steps used)."""
    with torch.no_grad():
        for i, c in enumerate(plain):
            model(ids[i:i + 1], past_key_values=c, use_cache=True)
        model(ids, past_key_values=static, use_cache=True)
        runner = DecodeGraph(model, static, max_new_tokens=len(steps), capture=False)
        assert runner.mode == "static"
        for t in steps:
            want = torch.cat([model(t[i:i + 1], past_key_values=c, use_cache=True).logits[:, -1]
                              for i, c in enumerate(plain)]).float()
            torch.testing.assert_close(runner.step(t), want, rtol=1e-4, atol=1e-4)
    return runner


@pytest.mark.parametrize("k,v,batch", [("q8_0", "turbo3", 1), ("turbo4", "turbo3", 2), ("f16", "f16", 1)])
def test_static_decode_matches_plain_kvcache(k, v, batch, monkeypatch):
    # the plain caches decode through the fused path too (its torch reference here), so both read
    # the step's own row compressed; the materialize path would use it exact
    monkeypatch.setattr("polykv.hf.kv_cache._fused_available", lambda q: True)
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ids = torch.randint(3, 120, (batch, 21))
    steps = torch.randint(3, 120, (6, batch, 1))
    plain = [KVCache(model, k=k, v=v) for _ in range(batch)]  # batch 1 each: the fused path
    static = KVCache(model, k=k, v=v)
    runner = decode_static_beside_plain(model, plain, static, ids, steps)
    with torch.no_grad(), pytest.raises(RuntimeError, match="max_new_tokens"):
        runner.step(steps[0])
    assert static.get_seq_length() == plain[0].get_seq_length() == 21 + len(steps)
    for i, c in enumerate(plain):
        for a, b in zip(c.layers, static.layers):
            n = a.store.length
            assert b.store.length == n
            # prefill rows bit-equal; decode rows equal up to rounding flips of ~1e-7 differences
            assert torch.equal(a.store.keys().codes[0, :, :21], b.store.keys().codes[i, :, :21])
            for x, y in zip(a.store.dense(), b.store.dense()):
                torch.testing.assert_close(x[0], y[i], rtol=0, atol=2e-2)


def test_needs_prefilled_cache():
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="prefilled"):
        DecodeGraph(model, KVCache(model), max_new_tokens=4)


def test_kvcache_holds_what_it_stores_after_a_prompt():
    """After a 1,285-token prompt the held bytes are the payload: storage exact to the row (not the
    next power of two, nor 1,344 rows rounded up to 64)."""
    model = tiny_llama(layers=2)
    cache = KVCache(model, k="q8_0", v="turbo3")
    with torch.no_grad():
        model(torch.randint(3, 120, (1, 1285)), past_key_values=cache, use_cache=True)
    rep = cache.memory_report()
    assert rep["kv_bytes"] == rep["kv_bytes_used"] > 0
    assert [lay.store.capacity for lay in cache.layers] == [1285, 1285]


def _padded_batch(lengths, vocab=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    L = max(lengths)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = s, 1
    return seqs, ids, mask


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels through Triton's interpreter, which "
                    "a process that found a GPU never enables (tests/conftest.py); on the GPU, left padding is "
                    "checked by tests/kernels/test_planned_launch_gpu.py")
def test_left_padded_batch_decodes_on_the_fused_kernel(monkeypatch):
    """A left-padded batch decodes through the fused kernel (Triton interpreter here), reading each
    sequence from its first real row (the mask's left padding): the logits equal each sequence
    decoded alone, without padding — eagerly through KVCache and through DecodeGraph's static step."""
    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    seqs, ids, mask = _padded_batch([19, 12, 16])
    steps = torch.randint(3, 120, (3, len(seqs), 1))
    pos0 = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = []
        for i, s in enumerate(seqs):
            c = KVCache(model, k="q8_0", v="turbo3")
            model(s[None], past_key_values=c, use_cache=True)
            alone.append([model(t[i:i + 1], past_key_values=c, use_cache=True).logits[0, -1]
                          for t in steps])
        for runner in ("eager", "static"):
            c = KVCache(model, k="q8_0", v="turbo3")
            model(ids, attention_mask=mask, position_ids=pos0, past_key_values=c, use_cache=True)
            m, pos = mask, pos0[:, -1:]
            dg = DecodeGraph(model, c, len(steps), capture=False, attention_mask=mask) if runner == "static" else None
            for j, t in enumerate(steps):
                m, pos = torch.cat([m, torch.ones(len(seqs), 1, dtype=m.dtype)], 1), pos + 1
                if dg is None:
                    got = model(t, attention_mask=m, position_ids=pos, past_key_values=c,
                                use_cache=True).logits[:, -1]
                else:
                    got = dg.step(t)
                for i in range(len(seqs)):
                    torch.testing.assert_close(got[i].float(), alone[i][j].float(), rtol=2e-3, atol=2e-3)


@pytest.mark.slow
def test_compiled_pointwise_same_outputs_and_undone():
    """compiled_pointwise compiles the norms, MLPs and the rotary function (inductor) inside the
    block — same logits, the compiled rotary function ran — and restores the eager code on exit."""
    from transformers.models.llama import modeling_llama

    from polykv.hf.graphs import compiled_pointwise

    model = tiny_llama(layers=2)
    x = torch.randint(3, 120, (2, 9))
    eager_rotary = modeling_llama.apply_rotary_pos_emb
    with torch.no_grad():
        ref = model(x).logits
        with compiled_pointwise(model) as n:
            assert n == 2 * 3 + 1 + 1  # 2 norms + 1 MLP per layer, the final norm; the rotary function
            gate, rotary_calls = modeling_llama.apply_rotary_pos_emb, []
            assert gate.eager is eager_rotary
            compiled_rotary = gate.compiled
            gate.compiled = lambda *a, **k: rotary_calls.append(1) or compiled_rotary(*a, **k)
            got = model(x).logits
            assert any(m._compiled_call_impl is not None for m in model.modules())
            assert len(rotary_calls) == 2  # each layer's attention rotated through the compiled function
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert all(m._compiled_call_impl is None for m in model.modules())
    assert modeling_llama.apply_rotary_pos_emb is eager_rotary
