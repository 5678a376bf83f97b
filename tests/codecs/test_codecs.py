"""Codec formats (DESIGN §3): error levels, exact bit budgets, rotation, norms, bad input."""

import math

import pytest
import torch

from polykv.codecs import (CODEC_NAMES, CodecError, get_codec, lloyd_max_codebook, rotate,
                           turbo_group_size, unrotate)
from polykv.codecs.packing import pack_indices, unpack_indices

TURBO_THEORY = {"turbo2": 0.1175, "turbo3": 0.03455, "turbo4": 0.009497}  # Gaussian Lloyd-Max


# --- the formats written out again from DESIGN §3 and the documented layouts ----------------------
# (explicit bit positions, numpy Hadamard; shared with tests/kernels/test_reference.py)

def spec_unpack(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Indices int64 [..., n] from packed bytes [..., n*bits/8] (packing.py's documented layout):
    bits in {1, 2, 4}: value i in byte i % (n/P) at bit bits*(i // (n/P)), P = 8 // bits; 3 bits: the
    low two bits as a 2-bit row (n/4 bytes), then the high bit as a 1-bit row (n/8 bytes); 8: bytes."""
    c = codes.to(torch.int64)
    if bits == 8:
        return c
    if bits == 3:
        return spec_unpack(codes[..., : n // 4], 2, n) | (spec_unpack(codes[..., n // 4:], 1, n) << 2)
    per = n // (8 // bits)
    out = torch.empty(*codes.shape[:-1], n, dtype=torch.int64)
    for i in range(n):
        out[..., i] = (c[..., i % per] >> (bits * (i // per))) & ((1 << bits) - 1)
    return out


def spec_rotation(g: int) -> torch.Tensor:
    """R [g, g] float64 with y = R x: R = D(s2) H_g/sqrt(g) D(s1), signs drawn as rotation.py documents."""
    import numpy as np

    from polykv.codecs.rotation import ROTATION_SEED

    h = np.array([[1.0]])
    while h.shape[0] < g:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    gen = torch.Generator().manual_seed(ROTATION_SEED + g)
    s1 = (torch.randint(0, 2, (g,), generator=gen) * 2 - 1).double()
    s2 = (torch.randint(0, 2, (g,), generator=gen) * 2 - 1).double()
    return s2[:, None] * torch.from_numpy(h / np.sqrt(g)) * s1[None, :]


def spec_decode(p, name: str, head_dim: int, rotated: bool = False) -> torch.Tensor:
    """float64 [..., head_dim] from packed rows, following DESIGN §3 (rotated: turbo storage domain)."""
    lead = p.codes.shape[:-1]
    if name in ("f16", "bf16"):
        return p.codes.double()
    if name == "q8_0":
        return (p.codes.double().reshape(*lead, -1, 32) * p.scales.double()[..., None]).reshape(*lead, head_dim)
    if name == "q4_0":  # the whole row packed (byte j: value j low nibble, j + head_dim/2 high)
        q = spec_unpack(p.codes, 4, head_dim).double() - 8
        return (q.reshape(*lead, -1, 32) * p.scales.double()[..., None]).reshape(*lead, head_dim)
    from polykv.codecs.turbo import turbo_codebook, turbo_group_size

    bits, g = int(name[5:]), turbo_group_size(head_dim)
    cent = turbo_codebook(bits, g)[0].double()
    codes = p.codes.reshape(*lead, head_dim // g, g * bits // 8)
    y = cent[spec_unpack(codes, bits, g)] * p.scales.double()[..., None]  # [..., groups, g]
    if not rotated:
        y = y @ spec_rotation(g)  # x = R^T y; as row vectors x = y R
    return y.reshape(*lead, head_dim)


def rel_mse(x, y):
    return float(((x - y) ** 2).sum() / (x ** 2).sum())


@pytest.fixture(scope="module")
def gauss():
    return torch.randn(8192, 128, generator=torch.Generator().manual_seed(0))


def test_lloyd_max_gaussian_3bit_matches_published_centroids():
    c, mse = lloyd_max_codebook(3, "gaussian")
    assert c[4:] == pytest.approx([0.2451, 0.7560, 1.3439, 2.1519], abs=1e-3)
    assert c[:4] == pytest.approx(-c[4:][::-1], abs=1e-12)
    assert mse == pytest.approx(0.03455, rel=1e-3)


@pytest.mark.parametrize("bits,mse_ref", [(1, 0.3634), (2, 0.1175), (4, 0.009497)])
def test_lloyd_max_gaussian_distortion(bits, mse_ref):
    _, mse = lloyd_max_codebook(bits, "gaussian")
    assert mse == pytest.approx(mse_ref, rel=2e-3)


def test_sphere_density_tends_to_gaussian():
    cg, _ = lloyd_max_codebook(3, "gaussian")
    cs, _ = lloyd_max_codebook(3, "sphere", 4096)
    assert cs == pytest.approx(cg, abs=2e-3)


@pytest.mark.parametrize("name", sorted(TURBO_THEORY))
def test_turbo_rel_mse_within_5pct_of_theory(gauss, name):
    codec = get_codec(name, 128)
    err = rel_mse(gauss, codec.decode(codec.encode(gauss)))
    assert abs(err / TURBO_THEORY[name] - 1) < 0.05, err


def test_turbo8_rel_mse(gauss):
    codec = get_codec("turbo8", 128)
    assert rel_mse(gauss, codec.decode(codec.encode(gauss))) < 1e-4


def test_q8_0_error_bounded_by_half_step(gauss):
    codec = get_codec("q8_0", 128)
    p = codec.encode(gauss)
    assert p.codes.dtype == torch.int8 and p.scales.dtype == torch.float16
    blocks = gauss.reshape(-1, 4, 32)
    d = (blocks.abs().amax(-1) / 127).half()  # DESIGN §3: fp16 scale amax/127
    assert torch.equal(p.scales, d)
    assert torch.equal(p.codes.reshape(-1, 4, 32).long(), torch.round(blocks / d.float()[..., None]).long())
    err = (codec.decode(p) - gauss).abs().reshape(-1, 4, 32)
    step = p.scales.float()[..., None]
    assert bool((err <= step / 2 + 1e-6).all())
    assert rel_mse(gauss, codec.decode(p)) < 5e-5


def test_q4_0_llama_cpp_semantics(gauss):
    codec = get_codec("q4_0", 128)
    p = codec.encode(gauss)
    y = codec.decode(p)
    blocks, yb = gauss.reshape(-1, 4, 32), y.reshape(-1, 4, 32)
    d = p.scales.float()
    # The block's largest-magnitude value maps to q = 0, i.e. -8 * d, reproduced up to fp16 rounding of d.
    idx = blocks.abs().argmax(-1, keepdim=True)
    assert torch.allclose(torch.gather(yb, -1, idx).squeeze(-1), -8 * d)
    assert torch.allclose(torch.gather(blocks, -1, idx).squeeze(-1), -8 * d, rtol=1e-3)
    err, step = (yb - blocks).abs(), d.abs()[..., None]
    inside = (blocks / d[..., None]).abs() <= 7.5  # the +8 side clamps to 7 (16 levels, -8..7)
    assert bool((err[inside] <= (step / 2 + 1e-3).expand_as(err)[inside]).all())
    assert bool((err <= step + 1e-3).all())
    assert 0.005 < rel_mse(gauss, y) < 0.01


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_bits_per_value_exact(head_dim):
    x = torch.randn(3, 5, head_dim)
    g = turbo_group_size(head_dim)
    expected = {"f16": 16, "bf16": 16, "q8_0": 8.5, "q4_0": 4.5, "turbo8": 8 + 16 / g,
                "turbo4": 4 + 16 / g, "turbo3": 3 + 16 / g, "turbo2": 2 + 16 / g}
    for name in CODEC_NAMES:
        codec = get_codec(name, head_dim)
        p = codec.encode(x)
        assert codec.bits_per_value(p) == expected[name], name
        assert p.nbytes() * 8 == expected[name] * x.numel()
    assert get_codec("turbo3", 128).bits_per_value() == 3.125


def test_group_rule():
    assert [turbo_group_size(d) for d in (32, 64, 128, 256, 512)] == [32, 64, 128, 128, 128]
    for bad in (16, 48, 96, 192, 100):
        with pytest.raises(CodecError, match="32 or 64, or a multiple of 128"):
            get_codec("turbo3", bad)


@pytest.mark.parametrize("name", ["turbo2", "turbo3", "turbo4", "turbo8"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_corrected_norm_preserves_length(name, head_dim):
    codec = get_codec(name, head_dim)
    x = torch.randn(257, head_dim) * 3.0
    y = codec.decode(codec.encode(x))
    g = codec.group
    nx = x.reshape(-1, g).norm(dim=-1)
    ny = y.reshape(-1, g).norm(dim=-1)
    assert torch.allclose(ny, nx, rtol=2e-3)  # fp16 norm: ~5e-4 relative


def test_rotation_is_orthogonal_and_invertible():
    q, k = torch.randn(64, 256), torch.randn(64, 256)
    for g in (32, 64, 128):
        assert torch.allclose((rotate(q, g) * rotate(k, g)).sum(-1), (q * k).sum(-1), atol=1e-3)
        assert torch.allclose(unrotate(rotate(q, g), g), q, atol=1e-5)
        assert not torch.allclose(rotate(q, g), q)


@pytest.mark.parametrize("g", [32, 64, 128])
def test_rotation_is_the_documented_matrix(g):
    """rotate applies D(s2) H_G/sqrt(G) D(s1) to every group, built here from a Sylvester Hadamard and
    the documented sign recipe."""
    x = torch.randn(5, 2 * g, dtype=torch.float64)
    want = (x.reshape(5, 2, g) @ spec_rotation(g).T).reshape(5, 2 * g)
    torch.testing.assert_close(rotate(x, g).double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(unrotate(want, g).double(), x, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_matches_format_spec(name, head_dim):
    """decode / decode_rotated = the DESIGN §3 formats decoded from the raw bytes by spec_decode."""
    codec = get_codec(name, head_dim)
    p = codec.encode(torch.randn(3, 5, head_dim) * 2)
    torch.testing.assert_close(codec.decode(p).double(), spec_decode(p, name, head_dim), atol=1e-5, rtol=1e-5)
    # the storage domain: centroid x norm for turbo types, the decoded values for the others
    torch.testing.assert_close(codec.decode_rotated(p).double(),
                               spec_decode(p, name, head_dim, rotated=codec.rotated), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["turbo2", "turbo3", "turbo4", "turbo8"])
def test_turbo_encode_matches_format_spec(name):
    """Indices = the nearest codebook centroid of y/||x||*sqrt(G) (y = R x), stored norm = ||x||/||c||
    (DESIGN §3), recomputed here in float64 with the documented rotation."""
    from polykv.codecs.turbo import turbo_codebook

    g, bits = 128, int(name[5:])
    codec = get_codec(name, 256)
    x = torch.randn(40, 256)
    p = codec.encode(x)
    cent = turbo_codebook(bits, g)[0].double()
    xg = x.double().reshape(40, 2, g)
    norm = xg.norm(dim=-1)
    u = (xg @ spec_rotation(g).T) / norm[..., None] * g ** 0.5
    idx = (u[..., None] - cent).abs().argmin(-1)
    got = spec_unpack(p.codes.reshape(40, 2, -1), bits, g)
    assert float((got != idx).float().mean()) < 1e-3  # a float32 rotation may flip an exact tie
    want_norm = norm / cent[got].norm(dim=-1)
    torch.testing.assert_close(p.scales.double(), want_norm.half().double(), atol=0, rtol=1e-3)


def test_attention_scores_in_rotated_domain():
    codec = get_codec("turbo4", 128)
    q, k = torch.randn(4, 128), torch.randn(50, 128)
    p = codec.encode(k)
    s_rot = codec.rotate(q) @ codec.decode_rotated(p).T
    s_true = q @ codec.decode(p).T
    assert torch.allclose(s_rot, s_true, atol=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_packing_roundtrip(bits):
    idx = torch.randint(0, 1 << bits, (7, 2, 128), dtype=torch.uint8)
    packed = pack_indices(idx, bits)
    assert packed.shape[-1] == 128 * bits // 8 and packed.dtype == torch.uint8
    assert torch.equal(spec_unpack(packed, bits, 128), idx.long())  # the documented layout
    assert torch.equal(unpack_indices(packed, bits, 128), idx)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unpack_word_and_byte_paths_agree(bits):
    """Rows whose bytes can be read as 64-bit words unpack 8 bytes per operation (packing._words);
    rows that cannot (a length not a multiple of 8 bytes, a view starting mid-word) take the
    per-byte path. Both give the documented layout (spec_unpack)."""
    from polykv.codecs import packing

    n = 128
    idx = torch.randint(0, 1 << bits, (5, 3, n + 8), dtype=torch.uint8)
    packed = pack_indices(idx, bits)
    whole = pack_indices(idx[..., :n], bits)
    assert packing._words(whole) is not None  # the word path runs on whole rows
    assert torch.equal(unpack_indices(whole, bits, n), idx[..., :n])
    # a view one byte into a wider row: no 8-byte-aligned word view, the byte path
    wide = torch.cat([torch.zeros(5, 3, 1, dtype=torch.uint8), whole], -1)[..., 1:]
    assert packing._words(wide) is None
    assert torch.equal(unpack_indices(wide, bits, n), idx[..., :n])
    # rows of n + 8 values: 3-bit planes of 34 / 17 bytes, 1-bit 17, 4-bit 68 (a multiple of 4, not 8)
    got = unpack_indices(packed, bits, n + 8)
    assert torch.equal(got, idx) and torch.equal(got.long(), spec_unpack(packed, bits, n + 8))


@pytest.mark.parametrize("name", ["turbo2", "turbo3", "turbo4", "turbo8"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_turbo_decode_is_the_centroid_times_the_norm_exactly(name, head_dim):
    """decode_rotated reads two centroids per gather (`turbo.pair_table`) for contiguous
    codes: the very floats of centroid[index] * norm, bit for bit, contiguous or not."""
    codec = get_codec(name, head_dim)
    p = codec.encode(torch.randn(6, 7, head_dim) * 3)
    cent = codec.tables("cpu")[0]
    want = (cent[codec.indices(p).long()] * p.scales.float()[..., None]).reshape(6, 7, head_dim)
    assert torch.equal(codec.decode_rotated(p), want)
    sub = p.index((slice(None), slice(1, 6, 2)))  # rows 1, 3, 5: non-contiguous codes
    assert torch.equal(codec.decode_rotated(sub), want[:, 1:6:2])


def test_turbo3_plane_layout():
    # planar: value i of n=32: low two bits in byte i % 8 at bits 2*(i // 8); high bit in byte
    # n/4 + i % 4 at bit i // 4
    idx = torch.zeros(1, 32, dtype=torch.uint8)
    idx[0, 21] = 0b110
    packed = pack_indices(idx, 3)
    assert packed[0, 5] == 0b10 << 4 and packed[0, 8 + 1] == 1 << 5
    assert int(packed.sum()) == (0b10 << 4) + (1 << 5)


def test_planar_pow2_layout():
    # 4-bit: byte j = value j (low nibble) | value j + n/2 (high nibble); 2-bit: value j + r*n/4 at 2r
    idx = torch.arange(16, dtype=torch.uint8)[None]
    p4 = pack_indices(idx, 4)
    assert p4[0].tolist() == [j | ((j + 8) << 4) for j in range(8)]
    idx2 = torch.tensor([[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.uint8)
    assert pack_indices(idx2, 2)[0].tolist() == [1 | (2 << 2) | (3 << 4) | (1 << 6), 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_input_dtypes_accepted(dtype):
    x = torch.randn(4, 128).to(dtype)
    for name in CODEC_NAMES:
        codec = get_codec(name, 128)
        assert codec.decode(codec.encode(x)).shape == (4, 128)


def test_zero_vectors_are_exact():
    x = torch.zeros(3, 128)
    for name in CODEC_NAMES:
        codec = get_codec(name, 128)
        assert torch.equal(codec.decode(codec.encode(x)), x), name


def test_bad_input_errors():
    with pytest.raises(CodecError, match="valid types: f16, bf16, q8_0, q4_0, turbo8, turbo4, turbo3, turbo2"):
        get_codec("turbo5", 128)
    codec = get_codec("turbo3", 128)
    with pytest.raises(CodecError, match="floating"):
        codec.encode(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(CodecError, match="non-finite"):
        codec.encode(torch.tensor([[math.nan] * 128]))
    with pytest.raises(CodecError, match="non-finite"):
        get_codec("q8_0", 128).encode(torch.full((1, 128), math.inf))
    with pytest.raises(CodecError, match="empty"):
        codec.encode(torch.zeros(0, 128))
    with pytest.raises(CodecError, match="last dim 128"):
        codec.encode(torch.zeros(2, 64))
    with pytest.raises(CodecError, match="multiple of 32"):
        get_codec("q8_0", 48)
