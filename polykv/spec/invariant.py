"""Row-invariant linear layers: every Linear of a model sees at least `min_rows` rows.

Why (measured, docs/speculative.md): a GEMM's rounding depends on its row count (MKL on this CPU:
M = 1, M = 2..15 and M >= 16 give three different results for the same row, ~1e-5 relative). K/V
rows are quantized on write (q8_0 rounding, turbo codebook bins), which turns such a last-bit
difference into a whole quantization step in some stored value now and then, and logits later move
by ~0.1-0.3: near-ties flip. So greedy answers depend on the shape of the forwards that computed
them — plain decoding already gives different answers for 2 of 8 demo prompts in a batch of 8 vs
alone — and a verify forward (G·(k+1) rows) differs from decode (G rows) the same way.

Padding every Linear input to >= min_rows rows (zeros; the output is cut back) puts every forward
in one GEMM regime, so a token's numbers no longer depend on how many rows ran beside it; with it,
speculative greedy output is token-identical to plain greedy output (tests/spec). It costs the
padded rows' FLOPs, so it is a test / reproducibility mode, not the default.

    with row_invariant(model):            # hooks on every nn.Linear, removed on exit
        pool.generate(...)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["row_invariant"]


@contextlib.contextmanager
def row_invariant(model, min_rows: int = 16):
    state: dict = {}

    def pre(mod, args):
        x = args[0]
        n = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < n < min_rows:
            pad = x.new_zeros(min_rows, x.shape[-1])
            pad[:n] = x.reshape(n, x.shape[-1])
            state[id(mod)] = (x.shape[:-1], n)
            return (pad,) + tuple(args[1:])
        state.pop(id(mod), None)
        return None

    def post(mod, args, out):
        s = state.pop(id(mod), None)
        if s is not None:
            lead, n = s
            return out[:n].reshape(*lead, out.shape[-1])
        return None

    handles = []
    try:
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                handles.append(mod.register_forward_pre_hook(pre))
                handles.append(mod.register_forward_hook(post))
        yield model
    finally:
        for h in handles:
            h.remove()
