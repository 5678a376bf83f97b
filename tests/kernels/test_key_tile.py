"""The phase kernel's key tile follows the keys a pass reads: a recent window's segment (8 rows) or
any pass over fewer than 64 keys decodes a 16- or 32-row tile, not 64 masked rows (offline sm_90
SASS of the 8-row segment program: 4,080 -> 2,019 instructions, spills gone;
docs/results/sass_segment_s17.json). Values are the reference's (interpreter)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from polykv.codecs import get_codec
from polykv.kernels import dispatch, reference
from polykv.kernels import triton_decode as td


@pytest.mark.parametrize("rows, tile", [(8, 16), (12, 16), (16, 16), (20, 32), (40, 64), (64, 64), (200, 64)])
def test_key_tile_follows_the_rows(interpreter, monkeypatch, rows, tile):
    seen = []
    launch = td.cached_launch

    def spy(kernel, grid, *args, plan=0, **kw):
        if kernel is td._phase_decode_kernel:
            seen.append(kw["BLOCK_N"])
        return launch(kernel, grid, *args, plan=plan, **kw)

    monkeypatch.setattr(td, "cached_launch", spy)
    c = get_codec("q8_0", 64)
    g = torch.Generator().manual_seed(rows)
    k, v = (c.encode(torch.randn(3, 1, rows, 64, generator=g)) for _ in range(2))
    q = torch.randn(3, 4, 1, 64, generator=g)
    start = torch.tensor([0, 1, rows // 2], dtype=torch.int32)
    out, lse = dispatch.attention_decode(q, k, v, c, c, window=8, kv_start=start)
    ref, ref_lse = reference.attention_decode_ref(q, k, v, c, c, window=8, kv_start=start)
    assert seen == [tile]
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)


TOOLS = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin"


def _sass_offline(args: list[str]) -> dict:
    """`polykv.bench.sass_segment.main(args)`'s one row, run in a fresh interpreter: this process
    runs Triton interpreted, which cannot compile."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "POLYKV_TRITON_ON_CPU")}
    code = f"import json; from polykv.bench.sass_segment import main; print(json.dumps(main({args!r})))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(res.stdout.strip().splitlines()[-1])
    return row


@pytest.mark.skipif(not (TOOLS / "ptxas").exists(), reason="Triton's bundled ptxas is missing")
def test_sass_segment_builds_offline():
    """`polykv.bench.sass_segment` (record in the interpreter, build for sm_90, count SASS)."""
    row = _sass_offline(["--block-n", "16"])
    assert row["block_n"] == 16 and row["HMMA"] > 0 and 500 < row["instructions"] < 3000
    assert row["LDL"] == row["STL"] == 0  # no spill at the 16-row tile


@pytest.mark.skipif(not (TOOLS / "ptxas").exists(), reason="Triton's bundled ptxas is missing")
def test_sass_segment_counts_a_decode_pair_offline():
    """`sass_segment --decode K/V` (kernels_notes v23's counts): one sequence's decode kernel in
    that pair builds for sm_90; turbo4 keys by the symmetric lookup take fewer byte permutes than
    the 918 of the two-half lookup they replaced."""
    row = _sass_offline(["--block-n", "64", "--decode", "turbo4/turbo3"])
    assert row["HMMA"] > 0 and 0 < row["PRMT"] < 918 and row["LDL"] == row["STL"] == 0
