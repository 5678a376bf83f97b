"""The engine on a GPU: a CUDA pool in bf16 serves requests through captured steps — plain
(pipelined and synchronous), several at once, and speculative — where every other engine test runs
on the CPU. `polykv serve` builds exactly this (`--device`, `--dtype`)."""

from __future__ import annotations

import pytest
import torch

from polykv.engine import Engine, GenerationRequest, SamplingParams
from polykv.pool import SharedKVPool
from tests.pool.conftest import CharTok

DOC = "The quick brown fox jumps over the lazy dog while the cat sleeps by the door. " * 12


def _answers(pool, doc, prompts, pipelined: bool, **request_kw) -> list[tuple[list[int], dict]]:
    """(token ids, usage) of each prompt, all submitted together to a fresh engine."""
    with Engine(pool, pipelined=pipelined) as eng:
        handles = [eng.submit(GenerationRequest(list(p), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                                document=doc, **request_kw)) for p in prompts]
        out = []
        for h in handles:
            ids, usage = [], None
            for ev in h.iter_sync(timeout=120):
                assert ev.kind != "error", ev.error
                if ev.kind == "token":
                    ids.append(ev.token_id)
                else:
                    usage = ev.usage
            out.append((ids, usage))
    return out


@pytest.mark.gpu
def test_engine_serves_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM

    from polykv.spec import SpecConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=1, pad_token_id=0, bos_token_id=2)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    tok = CharTok()
    pool = SharedKVPool(model, tok, k="q8_0", v="turbo3", progress=False)
    doc = pool.add_document(DOC)
    one = [tok("Where is the fox?")["input_ids"]]
    # one request alone: the pipelined and the synchronous loop run the same captured step
    (piped, usage), = _answers(pool, doc, one, pipelined=True)
    (synced, _), = _answers(pool, doc, one, pipelined=False)
    assert len(piped) == 12 and piped == synced and usage["completion_tokens"] == 12
    assert pool.device.type == "cuda"
    # several at once (different prompt lengths: left-padded prefill), and speculative
    prompts = [tok(q)["input_ids"] for q in ("Where is the fox?", "the lazy dog", "cat", "Tell me about the door")]
    for ids, usage in _answers(pool, doc, prompts, pipelined=True):
        assert len(ids) == 12 and usage["completion_tokens"] == 12
    spec = SpecConfig("prompt_lookup", 3)
    for ids, usage in _answers(pool, doc, prompts, pipelined=True, speculative=spec):
        assert len(ids) == 12 and "speculative" in usage
