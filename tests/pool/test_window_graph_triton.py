"""A model with sliding-window layers on the captured path's code (the static step, run eagerly) through
Triton's kernels (interpreter, fresh process: POLYKV_TRITON_ON_CPU=1): the windowed cascade serves
its sliding layers, and the static step gives the eager step's logits — what a CUDA graph of such a
model replays, checked without a GPU (graphs_supported no longer refuses windows)."""

import pytest

from tests.pool.conftest import run_interpreted

_SCRIPT = r"""
import json
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from polykv.kernels import dispatch
from tests.pool.conftest import CharTok
from tests.pool.test_decode_graph import _run

calls = []
real = dispatch._windowed_cascade
dispatch._windowed_cascade = lambda *a, **k: calls.append(1) or real(*a, **k)
torch.manual_seed(0)
cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
model = Gemma3ForCausalLM(cfg).eval()
sufs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
feeds = [[20 + 4 * i + j for j in range(4)] for i in range(5)]  # windows leave the document
a, _, a_lens, _ = _run(model, CharTok(), "q8_0", "turbo3", False, feeds, sufs)
n_eager = len(calls)
b, _, b_lens, _ = _run(model, CharTok(), "q8_0", "turbo3", True, feeds, sufs)
print(json.dumps({"diff": max(float((x - y).abs().max()) for x, y in zip(a, b)),
                  "lens": torch.equal(a_lens, b_lens), "eager_calls": n_eager,
                  "static_calls": len(calls) - n_eager}))
"""


@pytest.mark.slow
def test_sliding_window_static_step_on_the_kernels_interpreted():
    out = run_interpreted(_SCRIPT)
    assert out["lens"] and out["eager_calls"] > 0 and out["static_calls"] > 0, out
    assert out["diff"] <= 5e-5, out  # the static step's usual distance from eager (llama: 1e-5)
