"""Codec registry by name."""

from __future__ import annotations

import functools

import torch

from .base import Codec, CodecError
from .blockq import Q4_0, Q8_0
from .raw import RawCodec
from .turbo import TurboCodec

CODEC_NAMES = ("f16", "bf16", "q8_0", "q4_0", "turbo8", "turbo4", "turbo3", "turbo2")
"""Every KV storage type, most precise first."""


@functools.lru_cache(maxsize=None)
def get_codec(name: str, head_dim: int) -> Codec:
    """The codec `name` bound to `head_dim`. Raises CodecError for unknown names (listing the valid
    ones) or a head_dim the format does not support."""
    if not isinstance(name, str) or name not in CODEC_NAMES:
        raise CodecError(f"unknown KV type {name!r}; valid types: {', '.join(CODEC_NAMES)}")
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise CodecError(f"head_dim must be a positive int, got {head_dim!r}")
    if name == "f16":
        return RawCodec(head_dim, torch.float16, "f16")
    if name == "bf16":
        return RawCodec(head_dim, torch.bfloat16, "bf16")
    if name == "q8_0":
        return Q8_0(head_dim)
    if name == "q4_0":
        return Q4_0(head_dim)
    return TurboCodec(head_dim, int(name[len("turbo"):]))


def check_codec_name(name: str) -> str:
    """Validate a type name without binding a head_dim."""
    if name not in CODEC_NAMES:
        raise CodecError(f"unknown KV type {name!r}; valid types: {', '.join(CODEC_NAMES)}")
    return name
