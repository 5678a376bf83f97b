"""`polykv.bench.prefix_tile` through the Triton interpreter at a tiny size: every config's cascade
call runs the kernels and agrees with the reference; the config strings parse."""

import pytest

from polykv.bench.prefix_tile import parse_config, run
from polykv.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def test_parse_config():
    assert parse_config("64x4") == (64, 4, None)
    assert parse_config("32x8x256") == (32, 8, 256)


def test_prefix_tile_rows_cpu(monkeypatch):
    monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")  # the kernels, through the interpreter
    monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
    launched = []
    from polykv.kernels import dispatch

    # the name the cascade's passes call (patching triton_decode's reached them only when this
    # test happened to import triton_cascade first: order-dependent)
    cascade = dispatch._k()[1]
    real = cascade.decode_parts
    monkeypatch.setattr(cascade, "decode_parts", lambda *a, **kw: launched.append(kw.get("block_m_max")) or real(*a, **kw))
    r = run(agents=2, ctxs=(512,), n_qs=(2,), configs=((16, 4, None), (32, 4, 128), (32, 4, 512)),
            device="cpu", log=lambda *_: None)
    # the 512-key split does not fit twice in a 512-row prefix: skipped
    assert set(r) == {"P512_nq2_bm16_nw4", "P512_nq2_bm32_nw4_sl128"}
    assert all(x["us"] is None and x["rel"] < 1e-2 for x in r.values())
    assert 16 in launched and 32 in launched  # each config's row tile reached the prefix pass
