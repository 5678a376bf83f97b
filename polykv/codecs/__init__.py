"""KV codecs: block formats, rotation, Lloyd-Max codebooks, InnerQ, bit packing. Pure torch."""

from .base import Codec, CodecError, Packed
from .innerq import InnerQTable
from .lloyd_max import lloyd_max_codebook
from .registry import CODEC_NAMES, check_codec_name, get_codec
from .rotation import ROTATION_SEED, rotate, rotation_matrix, unrotate
from .turbo import TurboCodec, turbo_group_size

__all__ = [
    "CODEC_NAMES", "Codec", "CodecError", "InnerQTable", "Packed", "ROTATION_SEED", "TurboCodec",
    "check_codec_name", "get_codec", "lloyd_max_codebook", "rotate", "rotation_matrix",
    "turbo_group_size", "unrotate",
]
