"""Attention / quantize kernels over packed KV (DESIGN §4).

Public: attention_decode, cascade_attention, merge_attention, quantize_into (quantize_kv_into: K
and V of a step in one launch), dequantize, force_reference. Triton is imported only when a kernel actually runs (CUDA tensors, or
POLYKV_TRITON_ON_CPU=1 / TRITON_INTERPRET=1 for the interpreter); reference.py is pure torch.
"""

from .dispatch import (attention_decode, cascade_attention, dequantize, force_reference,
                       gather_pages, merge_attention, quantize_into, quantize_kv_into,
                       triton_available, use_triton)
from .reference import (attention_decode_ref, cascade_attention_ref, dequantize_ref,
                        merge_attention_ref, quantize_ref)

__all__ = [
    "attention_decode", "attention_decode_ref", "cascade_attention", "cascade_attention_ref",
    "dequantize", "dequantize_ref", "force_reference", "gather_pages", "merge_attention", "merge_attention_ref",
    "quantize_into", "quantize_kv_into", "quantize_ref", "triton_available", "use_triton",
]
