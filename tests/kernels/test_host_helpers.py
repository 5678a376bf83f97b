"""Host-side helpers of the kernels' launch paths (no kernel runs here)."""

import triton

from polykv.codecs import get_codec
from polykv.kernels import triton_codec
from polykv.kernels.triton_codec import asm_strings, cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton():
    for n in range(0, 4100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_asm_strings_built_once_per_codec_and_equal_to_a_fresh_build():
    for name in ("q8_0", "q4_0", "turbo2", "turbo3", "turbo4"):
        for d in (64, 128):
            codec = get_codec(name, d)
            first = asm_strings(codec)
            assert asm_strings(get_codec(name, d)) is first  # cached: no PTX rebuilt per call
            assert first == triton_codec._build_asm_strings(codec)
    # different codebooks, different strings
    assert asm_strings(get_codec("turbo3", 128)) != asm_strings(get_codec("turbo4", 128))


def test_codec_meta_cached_per_codec_and_equal_to_a_fresh_build():
    """codec_meta / phase_meta are built once per codec key, read-only, and each key's own: the
    group of a turbo codec (D 256 rotates in two groups of 128, D 64 in one of 64) is part of it."""
    import pytest

    for name in ("f16", "q8_0", "q4_0", "turbo2", "turbo3", "turbo4"):
        for d in (64, 128, 256):
            codec = get_codec(name, d)
            meta = triton_codec.codec_meta(codec)
            assert triton_codec.codec_meta(get_codec(name, d)) is meta
            assert dict(meta) == triton_codec._codec_meta(codec)
            assert triton_codec.phase_meta(codec)["GW"] == meta["GW"]
            with pytest.raises(TypeError):
                meta["KIND"] = 0  # shared between calls: nobody may change it
    assert triton_codec.codec_meta(get_codec("turbo3", 64))["G"] == 64
    assert triton_codec.codec_meta(get_codec("turbo3", 256))["G"] == 128
