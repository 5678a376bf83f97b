"""The decode kernels' PTX strings (triton_codec.asm_strings), run on the CPU by a small emulator of
the PTX they use: every string must give, for every code byte, exactly the fp16 bits of the
reference decode (the table lookup of `_phase` / `_q4_phase` with DEC=0, q8_0's int8 cast).

The warp-specialised prefix pass takes the same strings rewritten for one word per element
(`gluon_prefix.unpacked`); that form must give the same values. Triton's interpreter cannot run
inline asm, so without this the strings are checked only on a GPU (gpu_suite's dec=asm rows)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from polykv.codecs import get_codec
from polykv.kernels.triton_codec import asm_strings, codec_meta

M32 = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    """prmt.b32 default mode: result byte k is byte (c & 7) of {b:a} (a = bytes 0-3), or that
    byte's sign replicated when c & 8; c = nibble k of sel."""
    src = (b << 32) | a
    out = 0
    for k in range(4):
        c = (sel >> (4 * k)) & 0xF
        byte = (src >> (8 * (c & 7))) & 0xFF
        if c & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _f16x2(op, a: int, b: int) -> int:
    x = np.array([a & 0xFFFF, a >> 16], dtype=np.uint16).view(np.float16)
    y = np.array([b & 0xFFFF, b >> 16], dtype=np.uint16).view(np.float16)
    r = op(x, y).astype(np.float16).view(np.uint16)
    return int(r[0]) | (int(r[1]) << 16)


_OPS = {
    "mov.b32": lambda a: a,
    "shr.b32": lambda a, n: (a & M32) >> n,
    "shl.b32": lambda a, n: (a << n) & M32,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "prmt.b32": _prmt,
    "sub.f16x2": lambda a, b: _f16x2(np.subtract, a, b),
    "lo16": lambda a: a & 0xFFFF,
    "hi16": lambda a: a >> 16,
}


def _run(asm: str, regs: dict) -> dict:
    """Execute a string's statements on `regs` (name -> uint32), which it updates and returns."""
    # a register pair unpacked from a word: "mov.b32 {$0, $1}, w" (gluon_prefix.unpacked)
    asm = re.sub(r"mov\.b32 \{(\S+), (\S+)\}, (\w+)", r"lo16 \1, \3; hi16 \2, \3", asm)
    for stmt in asm.replace("{", ";").replace("}", ";").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        dst, *srcs = [s.strip() for s in rest.split(",")]
        vals = [regs[s] if not re.fullmatch(r"(0x[0-9a-fA-F]+|\d+)", s) else int(s, 0) for s in srcs]
        regs[dst] = _OPS[op](*vals) & M32
    return regs


def emulate(asm: str, x2: int, x3: int) -> tuple[int, int]:
    """Run one string on inputs $2, $3 (uint32); returns ($0, $1)."""
    regs = _run(asm, {"$2": x2, "$3": x3})
    return regs["$0"], regs["$1"]


def _table(codec) -> list[int]:
    """fp16 bits of the decoded value of each index (no norm / scale)."""
    m = codec_meta(codec)
    if m["KIND"] == 2:  # q4_0: i - 8
        vals = np.arange(16) - 8.0
    else:
        vals = codec.centroids.numpy()
    return [int(v) for v in np.asarray(vals, dtype=np.float16).view(np.uint16)]


def _expected(codec, p: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """uint16 [n, 4]: the reference decode of phase p for code bytes lo, hi [n, 4] (uint8)."""
    m = codec_meta(codec)
    lo, hi = lo.astype(np.int64), hi.astype(np.int64)
    if m["KIND"] == 1:  # q8_0: int8 -> fp16
        return lo.astype(np.uint8).view(np.int8).astype(np.float16).view(np.uint16)
    bits = m["BITS"]
    if bits == 4:
        idx = (lo >> (4 * p)) & 15
    elif bits == 2:
        idx = (lo >> (2 * p)) & 3
    else:
        idx = ((lo >> (2 * (p // 2))) & 3) | (((hi >> p) & 1) << 2)
    return np.asarray(_table(codec), dtype=np.uint16)[idx]


def _words(rng, n: int) -> np.ndarray:
    """uint8 [n, 4] code bytes: every byte value in every lane, then random words."""
    every = np.stack([np.roll(np.arange(256), 61 * k) for k in range(4)], axis=1)
    return np.concatenate([every, rng.integers(0, 256, size=(n, 4))]).astype(np.uint8)


CODECS = [("q8_0", 128), ("q4_0", 128), ("turbo4", 128), ("turbo4", 64), ("turbo4", 256),
          ("turbo3", 128), ("turbo3", 64), ("turbo2", 128)]


@pytest.mark.parametrize("name,head_dim", CODECS)
def test_every_phase_string_decodes_like_the_reference(name, head_dim):
    codec = get_codec(name, head_dim)
    strings = asm_strings(codec)
    nph = codec_meta(codec)["NPH"]
    rng = np.random.default_rng(0)
    lo, hi = _words(rng, 512), _words(rng, 512)[::-1].copy()
    for p in range(nph):
        assert strings[p], f"{name}: phase {p} has no string"
        got = np.zeros((len(lo), 4), dtype=np.uint16)
        for r, (a, b) in enumerate(zip(lo.view("<u4")[:, 0], hi.view("<u4")[:, 0])):
            o0, o1 = emulate(strings[p], int(a), int(b))
            got[r] = [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16]
        want = _expected(codec, p, lo, hi)
        bad = np.argwhere(got != want)
        assert not len(bad), (f"{name} D{head_dim} phase {p}: {len(bad)} values differ, first at word "
                              f"{lo[bad[0][0]].tolist()}: {got[tuple(bad[0])]:#06x} vs {want[tuple(bad[0])]:#06x}")


@pytest.mark.parametrize("name", ["q8_0", "turbo3", "turbo4", "turbo2"])
def test_the_cascade_producers_word_form_decodes_the_same(name):
    """`gluon_prefix.unpacked` (the warp-specialised prefix pass's form of a string: words in $4 /
    $5, one fp16 per output $0..$3) gives the fp16 values of the string it was made from."""
    pytest.importorskip("triton.experimental.gluon")
    from polykv.kernels.gluon_prefix import unpacked

    codec = get_codec(name, 128)
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, size=(300, 2), dtype=np.uint64)
    for p, asm in enumerate(s for s in asm_strings(codec) if s):
        word_form = unpacked(asm)
        for a, b in words.tolist():
            o0, o1 = emulate(asm, a, b)
            regs = _run(word_form, {"$4": a, "$5": b})
            assert [regs[f"${j}"] for j in range(4)] == [o0 & 0xFFFF, o0 >> 16, o1 & 0xFFFF, o1 >> 16], \
                f"{name} phase {p}"


def test_the_emulator_sees_a_wrong_table():
    """A string built from another table must fail the comparison (the check can fail)."""
    codec = get_codec("turbo4", 128)
    other = asm_strings(get_codec("q4_0", 128))[0]
    lo = np.arange(256, dtype=np.uint8).repeat(4).reshape(-1, 4)
    got = [emulate(other, int(w), 0)[0] & 0xFFFF for w in lo.view("<u4")[:, 0]]
    assert np.any(np.asarray(got, dtype=np.uint16) != _expected(codec, 0, lo, lo)[:, 0])
