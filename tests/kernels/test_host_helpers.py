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


def test_env_flags_follow_os_environ_as_it_changes(monkeypatch):
    """dispatch reads its flags from os.environ's own dict (host time), so a variable set or
    removed after import — by a test, by a user — is seen by the next call."""
    import torch

    from polykv.kernels import dispatch

    monkeypatch.setattr(dispatch, "_FORCE", None)
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
    cpu = torch.zeros(1)
    assert not dispatch._forced() and dispatch.use_triton(cpu, cpu)
    monkeypatch.setenv("POLYKV_FORCE_REFERENCE", "1")
    assert dispatch._forced() and not dispatch.use_triton(cpu, cpu)
    monkeypatch.setenv("POLYKV_FORCE_REFERENCE", "0")
    assert not dispatch._forced()
    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "0")
    assert not dispatch._interp() and not dispatch.use_triton(cpu)
    monkeypatch.delenv("POLYKV_TRITON_ON_CPU")
    assert not dispatch._interp()
    # a flag read from a mapping without CPython's internals still follows it
    env = {}
    monkeypatch.setattr(dispatch.os, "environ", env)
    flag = dispatch._env_is_one("POLYKV_X")
    assert not flag()
    env["POLYKV_X"] = "1"
    assert flag()
    # a mixed call (a CUDA tensor among CPU ones) never takes the kernels
    monkeypatch.setattr(dispatch.os, "environ", {"POLYKV_TRITON_ON_CPU": "1"})
    monkeypatch.setattr(dispatch, "_CPU_ENV", dispatch._env_is_one("POLYKV_TRITON_ON_CPU"))
    assert dispatch.use_triton(torch.zeros(1), torch.zeros(1, 1))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.dim() == 2), raising=False)
    assert not dispatch.use_triton(torch.zeros(1), torch.zeros(1, 1))
