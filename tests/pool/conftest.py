import pytest
import torch


class CharTok:
    """Minimal tokenizer for tiny random models: one id per character (ids 3..), no chat template."""

    pad_token_id = 0
    eos_token_id = 1
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + (ord(c) % 120) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (i % 26)) for i in ids if i > 2)

    def get_vocab(self):
        return {chr(i): i for i in range(128)}


def tiny_llama(seed=0, layers=2, head_dim=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=1024, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(heads: int = 2, kv_heads: int = 1, seed: int = 0, head_dim: int = 32):
    """3-layer random Gemma-3 (sliding window 8 on layers 0-1, full attention on layer 2)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny():
    return tiny_llama(), CharTok()


def run_interpreted(script: str, timeout: int = 1200) -> dict:
    """Run a Python script in a fresh process with the Triton kernels interpreted on CPU
    (POLYKV_TRITON_ON_CPU=1, TRITON_INTERPRET=1 before triton is imported) from the repository
    root; returns the JSON object its last line prints."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, POLYKV_TRITON_ON_CPU="1", TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
