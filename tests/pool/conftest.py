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


def tiny_llama(seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(heads: int = 2, kv_heads: int = 1, seed: int = 0):
    """3-layer random Gemma-3 (sliding window 8 on layers 0-1, full attention on layer 2)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
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
