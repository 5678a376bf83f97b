"""Fixtures of the quality-harness tests: SmolLM2's real tokenizer and a tiny random Llama over it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from polykv.hf.loading import REGISTRY, _ensure_registry_cache

    return AutoTokenizer.from_pretrained(_ensure_registry_cache(REGISTRY["smollm2-135m"]))


@pytest.fixture(scope="module")
def tiny(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama with head_dim 64 (turbo rows of 32 / 64 channels) and sharp attention, so
    a simulation's errors stand well above float noise (test_heads.py, test_outliers.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      initializer_range=0.3)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_dir(tiny, tok, tmp_path_factory):
    """The tiny model and the tokenizer as a local HF directory (for `--model DIR` through the CLI)."""
    d = tmp_path_factory.mktemp("tiny")
    tiny.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def ppl_cli(model_dir: str, *options: str):
    """`polykv eval ppl --k turbo3 --v turbo2 --ctx 128 --windows 1 OPTIONS --model DIR --json` through
    typer's runner: (the result, its JSON object or None when the command failed)."""
    import json

    from typer.testing import CliRunner

    from polykv.eval.cli import app

    res = CliRunner().invoke(app, ["ppl", "--k", "turbo3", "--v", "turbo2", "--ctx", "128", "--windows", "1",
                                   *options, "--model", model_dir, "--json"])
    return res, (json.loads(res.stdout.strip().splitlines()[-1]) if res.exit_code == 0 else None)
