"""GPU suite for polykv/kernels (one device call): correctness at full size vs reference.py, then
timings. Usage (repo root, CUDA machine):  PYTHONPATH=. python3 polykv/bench/gpu_suite.py
Writes $OUT/gpu_suite.json (or ./gpu_suite.json) and prints a short table last.
Env: SUITE_QUICK=1 for a smaller run; SUITE_SKIP=tune,cascade,... to skip sections.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())

from polykv.bench.attention import _median_ms, _time, bench_one  # noqa: E402
from polykv.codecs import CODEC_NAMES, Packed, get_codec  # noqa: E402
from polykv.kernels import (attention_decode, attention_decode_ref, cascade_attention,  # noqa: E402
                            cascade_attention_ref, dequantize, dequantize_ref, merge_attention,
                            merge_attention_ref, quantize_into, quantize_kv_into)
from polykv.kernels.reference import RecentSegment  # noqa: E402

OUT = os.environ.get("OUT", ".")
RES: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": [], "tune": [], "decode": [],
             "cascade": [], "quantize": [], "errors": []}
SKIP = set(filter(None, os.environ.get("SUITE_SKIP", "").split(",")))
DEV = "cuda"


def save():
    with open(os.path.join(OUT, "gpu_suite.json"), "w") as f:
        json.dump(RES, f, indent=1, default=str)


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def section(name):
    def deco(fn):
        def run(*a, **k):
            if name in SKIP:
                return None
            t = time.time()
            try:
                return fn(*a, **k)
            except Exception:  # keep going: one broken section must not lose the others
                tb = traceback.format_exc()
                log(f"!! section {name} failed\n{tb}")
                RES["errors"].append({"section": name, "tb": tb})
            finally:
                log(f"-- {name}: {time.time() - t:.1f}s")
                save()
        return run
    return deco


def check(name, ok, **info):
    RES["checks"].append(dict(name=name, ok=bool(ok), **info))
    log(f"[{'ok' if ok else 'FAIL'}] {name} {info}")
    save()  # a run stopped by its time limit keeps every check it made (session 27: none kept)


@section("env")
def env():
    p = torch.cuda.get_device_properties(0)
    import triton
    RES["env"] = dict(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__,
                      triton=triton.__version__, l2=getattr(p, "L2_cache_size", None))
    n = 1 << 30  # 1 GiB copy: bytes read + written
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = _median_ms(lambda: b.copy_(a))
    RES["copy_gbps"] = 2 * n / ms / 1e6
    log("env", RES["env"], f"copy {RES['copy_gbps']:.0f} GB/s")
    del a, b


@section("correct")
def correctness():
    g = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*s, dtype=torch.float16):
        return torch.randn(*s, device=DEV, generator=g).to(dtype)

    # decode: full Llama-8B layer shape, several pairs, odd lengths, n_q 1 and 4
    pairs = [("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo3"), ("f16", "f16"),
             ("q4_0", "turbo2"), ("turbo8", "q8_0"), ("bf16", "turbo4"), ("turbo2", "q4_0")]
    # the phase kernel (v5) on every pair with both decoders; the tile kernel (v4, checked in
    # earlier runs) on two pairs
    cases = [(pr, nq, dm, "phase") for pr in pairs
             for nq, dm in ((1, "asm"), (1, "select"), (4, "auto"))]
    cases += [(pr, 1, "asm", "tile") for pr in pairs[:2]]
    for (kn, vn), n_q, dec, impl in cases:
        if True:
            D, S = 128, 16411
            kc, vc = get_codec(kn, D), get_codec(vn, D)
            k = kc.encode(rnd(2, 8, S, D))
            v = vc.encode(rnd(2, 8, S, D))
            q = rnd(2, 32, n_q, D)
            lens = torch.tensor([S, 9001], dtype=torch.int32, device=DEV)
            try:
                o, l = attention_decode(q, k, v, kc, vc, kv_lens=lens, impl=impl,
                                        dec=dec if dec != "asm" or kn not in ("f16", "bf16")
                                        or vn not in ("f16", "bf16") else "auto")
            except Exception as e:  # noqa: BLE001
                check(f"decode {kn}/{vn} D{D} S{S} nq{n_q} dec={dec} {impl}", False,
                      err=repr(e)[:400])
                continue
            o2, l2 = attention_decode_ref(q, k, v, kc, vc, kv_lens=lens)
            check(f"decode {kn}/{vn} D{D} S{S} nq{n_q} dec={dec} {impl}", rel(o, o2) <= 1e-2
                  and (l - l2).abs().max().item() < 1e-2, rel=rel(o, o2),
                  lse_err=(l - l2).abs().max().item())
    for D, group in ((64, 8), (256, 2), (512, 1)):
        kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
        k, v = kc.encode(rnd(1, 4, 4099, D)), vc.encode(rnd(1, 4, 4099, D))
        q = rnd(1, 4 * group, 2, D)
        o, l = attention_decode(q, k, v, kc, vc, window=1000)
        o2, l2 = attention_decode_ref(q, k, v, kc, vc, window=1000)
        check(f"decode q8_0/turbo3 D{D} g{group} window", rel(o, o2) <= 1e-2, rel=rel(o, o2))
    # cascade: 8 agents on a 64k prefix
    for kn, vn in (("q8_0", "turbo3"), ("turbo4", "turbo3")):
        kc, vc = get_codec(kn, 128), get_codec(vn, 128)
        pk, pv = kc.encode(rnd(1, 8, 65536, 128)), vc.encode(rnd(1, 8, 65536, 128))
        sk, sv = kc.encode(rnd(8, 8, 128, 128)), vc.encode(rnd(8, 8, 128, 128))
        sl = torch.tensor([128, 0, 1, 77, 128, 5, 64, 100], dtype=torch.int32, device=DEV)
        q = rnd(8, 32, 1, 128)
        o, l = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
        o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
        check(f"cascade {kn}/{vn} 8 agents 64k", rel(o, o2) <= 1e-2, rel=rel(o, o2),
              lse_err=(l - l2).abs().max().item())
    # head_dim 64 (SmolLM2: 3 KV / 9 q heads), 32 agents, verify-width query columns: the tile
    # kernel's prefix pass, 32-row tiles where 64-row ones would plan one-key-tile splits (2k)
    kc, vc = get_codec("q8_0", 64), get_codec("turbo3", 64)
    for ctx in (2048, 16384):
        pk, pv = kc.encode(rnd(1, 3, ctx, 64)), vc.encode(rnd(1, 3, ctx, 64))
        sk, sv = kc.encode(rnd(32, 3, 80, 64)), vc.encode(rnd(32, 3, 80, 64))
        sl = 5 + torch.arange(32, dtype=torch.int32, device=DEV) * 2  # each agent's rows hold its columns
        for n_q in (1, 3, 5):
            q = rnd(32, 9, n_q, 64)
            o, l = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
            o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
            check(f"cascade D64 32 agents {ctx} n_q {n_q}", rel(o, o2) <= 1e-2, rel=rel(o, o2),
                  lse_err=(l - l2).abs().max().item())
    # the warp-specialised prefix pass (Hopper: gluon_prefix) at every row-tile shape, partial
    # key tiles (lengths not a multiple of 64), an empty split, and chunked == whole bit for bit
    from polykv.kernels.gluon_prefix import ws_ok, ws_prefix
    from polykv.kernels.triton_cascade import _prefix_lens
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    for ctx, agents, sfx in ((4097, 5, 7), (20000, 32, 33), (65536, 64, 64), (1000, 17, 1)):
        pk, pv = kc.encode(rnd(1, 8, ctx, 128)), vc.encode(rnd(1, 8, ctx, 128))
        sk, sv = kc.encode(rnd(agents, 8, sfx, 128)), vc.encode(rnd(agents, 8, sfx, 128))
        sl = torch.full((agents,), sfx, dtype=torch.int32, device=DEV)
        q = rnd(agents, 32, 1, 128)
        o, l = cascade_attention(q, pk, pv, sk, sv, sl, kc, vc)
        o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, sl, kc, vc)
        check(f"cascade ws q8_0/turbo3 {agents} agents {ctx}", rel(o, o2) <= 1e-2, rel=rel(o, o2),
              lse_err=(l - l2).abs().max().item(), ws=ws_ok(q.new_zeros(1, 8, 4 * agents, 128),
                                                          kc, vc))
    ctx = 65536
    pk, pv = kc.encode(rnd(1, 8, ctx, 128)), vc.encode(rnd(1, 8, ctx, 128))
    qp = rnd(1, 8, 128, 128, dtype=torch.float32)
    cut = lambda p, a, b: type(p)(p.codes[:, :, a:b], p.scales[:, :, a:b])  # noqa: E731
    whole = ws_prefix(qp, [(pk, pv, _prefix_lens(ctx, DEV), 0)], ctx, kc, vc, sm_scale=0.0884,
                      max_split=16384)
    parts = ws_prefix(qp, [(cut(pk, a, a + 16384), cut(pv, a, a + 16384),
                            _prefix_lens(16384, DEV), a) for a in range(0, ctx, 16384)],
                      ctx, kc, vc, sm_scale=0.0884, max_split=16384)
    check("cascade ws chunked == whole", torch.equal(whole[0], parts[0])
          and torch.equal(whole[1], parts[1]))
    # the dense-cascade anchor itself vs SDPA over prefix+suffix
    from polykv.bench.attention import dense_cascade
    q = rnd(3, 32, 1, 128)
    pk, pv = rnd(1, 8, 1000, 128), rnd(1, 8, 1000, 128)
    sk, sv = rnd(3, 8, 7, 128), rnd(3, 8, 7, 128)
    o = dense_cascade(q, pk, pv, sk, sv)
    kk, vv = torch.cat([pk.expand(3, -1, -1, -1), sk], 2), torch.cat([pv.expand(3, -1, -1, -1), sv], 2)
    o2 = torch.nn.functional.scaled_dot_product_attention(q.float(), kk.float(), vv.float(),
                                                          enable_gqa=True)
    check("dense cascade anchor", rel(o.float(), o2) <= 5e-3, rel=rel(o.float(), o2))
    oa, ob = rnd(4, 32, 1, 128), rnd(4, 32, 1, 128)
    la, lb = rnd(4, 32, 1, dtype=torch.float32), rnd(4, 32, 1, dtype=torch.float32)
    la[0] = float("-inf")
    o, l = merge_attention(oa, la, ob, lb)
    o2, l2 = merge_attention_ref(oa, la, ob, lb)
    check("merge", rel(o, o2) <= 1e-3, rel=rel(o, o2))
    # quantize-on-write exactness and dequant (turbo also from fp16 rows: the one-dot rotation)
    for name in CODEC_NAMES:
        for D in (64, 128, 256):
            c = get_codec(name, D)
            for dt in ((torch.float32, torch.float16) if c.rotated else (torch.float32,)):
                x = (rnd(2, 8, 257, D, dtype=torch.float32) * 2).to(dt)
                ref = c.encode(x.float())
                dst = c.empty((2, 8, 300), device=DEV)
                quantize_into(dst, x, c, torch.tensor([5, 40], device=DEV))
                got = Packed(torch.stack([dst.codes[0, :, 5:262], dst.codes[1, :, 40:297]]),
                             None if dst.scales is None else
                             torch.stack([dst.scales[0, :, 5:262], dst.scales[1, :, 40:297]]))
                tag = f"quantize {name} D{D}" + ("" if dt == torch.float32 else " fp16")
                if c.rotated:
                    # Rotation summed in another order: a coordinate within ulps of a boundary may take the
                    # neighbouring index; groups whose indices all agree must match to one fp16 ulp, a group
                    # with a flipped index shifts its corrected norm by that centroid change: sum(c^2) moves
                    # by at most the largest gap between adjacent c^2 out of ~G (unit-variance codebook),
                    # the norm by half that (turbo3, G 128: 1.1 %; a 1 % bound failed once on the H200).
                    differs = c.indices(got) != c.indices(ref)  # [..., n_groups, G]
                    mis = differs.float().mean().item()
                    srel_all = ((got.scales.float() - ref.scales.float()).abs()
                                / ref.scales.float().abs().clamp_min(1e-6))
                    flipped = differs.any(-1)
                    srel = srel_all[~flipped].max().item()
                    srel_flip = srel_all[flipped].max().item() if bool(flipped.any()) else 0.0
                    c2 = c.centroids.float().sort().values ** 2
                    flip_tol = 0.6 * float(c2.diff().abs().max()) / c.group
                    check(tag, mis <= 1e-3 and srel <= 1.1e-3 and srel_flip <= flip_tol,
                          idx_mismatch=mis, norm_rel=srel, norm_rel_flipped=srel_flip,
                          norm_rel_flipped_bound=flip_tol)
                else:
                    same = torch.equal(got.codes.view(torch.uint8) if got.codes.dtype != torch.bfloat16
                                       else got.codes.view(torch.int16),
                                       ref.codes.view(torch.uint8) if ref.codes.dtype != torch.bfloat16
                                       else ref.codes.view(torch.int16))
                    same = same and (ref.scales is None or torch.equal(got.scales, ref.scales))
                    check(f"{tag} bit-exact", same)
            dq = dequantize(ref, c, torch.float32)
            check(f"dequant {name} D{D}", rel(dq, dequantize_ref(ref, c, torch.float32)) <= 1e-4,
                  rel=rel(dq, dequantize_ref(ref, c, torch.float32)))



@section("correct_heads")
def correctness_heads():
    """A layer with per-head types (issue K) on the fused path: one kernel per group of heads
    (`kv_cache._decode_stored`), against attention over each head's decoded rows."""
    from polykv.hf.kv_cache import LayerLayout, PolyKVLayer, _decode_stored

    g = torch.Generator(device=DEV).manual_seed(5)
    H, G, D, S = 8, 4, 128, 4099
    types = [("turbo3", "turbo2"), ("q8_0", "turbo3")] * 3 + [("turbo4", "turbo3"), ("q8_0", "q8_0")]
    scales = 0.5 + torch.rand(H, D, device=DEV, generator=g)
    layer = PolyKVLayer(LayerLayout(0, H, D, None), "f16", "f16", key_scales=scales, device=DEV,
                        head_types=types)
    k, v = (torch.randn(1, H, S, D, device=DEV, generator=g).half() for _ in range(2))
    layer.update(k, v)
    q = torch.randn(1, H * G, 1, D, device=DEV, generator=g).half()
    out, lse = _decode_stored(layer, q, S, causal=True, sm_scale=D ** -0.5)
    dk, dv = layer.store.dense()
    scores = (q.float() @ dk.repeat_interleave(G, 1).transpose(-1, -2)) * D ** -0.5
    want = torch.softmax(scores, -1) @ dv.repeat_interleave(G, 1)
    err = (lse - torch.logsumexp(scores, -1)).abs().max().item()
    check(f"per-head layer fused decode D{D} S{S} ({len(layer.store.groups)} groups)",
          rel(out.float(), want) <= 1e-2 and err < 1e-2, rel=rel(out.float(), want), lse_err=err)


TUNE_BEST: dict = {}


@section("tune")
def tune():
    """Sweep of the decode kernel's launch parameters at 64k (best per pair): the tile kernel (v4)
    at its defaults against the phase kernel (v5) over row tile, warps, stages and programs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfgs = [dict(impl="tile")] + [
        dict(impl="phase", block_n=bn, num_warps=w, num_stages=st, target_programs=t * sms)
        for bn, w, st, t in [(64, 1, 2, 8), (64, 1, 2, 10), (64, 1, 2, 11), (64, 1, 2, 12),
                             (64, 1, 3, 12), (64, 1, 2, 13), (32, 1, 2, 12)]] + [dict(impl="auto")]
    quick = {"q8_0/turbo3": cfgs}
    for kn, vn in (("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo3")):
        pair = f"{kn}/{vn}"
        if pair in quick:
            todo = quick[pair]
        else:  # the three best of the first pair, and the tile kernel
            ranked = sorted((r for r in RES["tune"] if r.get("pair") == "q8_0/turbo3" and "ms" in r),
                            key=lambda r: r["ms"])
            todo = [dict(impl="tile"), dict(impl="auto")] + [
                r["cfg"] for r in ranked if r["cfg"]["impl"] == "phase"][:2]
        best = None
        for cfg in todo:
            try:
                r = bench_one(65536, 1, kn, vn, sdpa=False, tune=cfg)
            except Exception as e:  # noqa: BLE001
                log(f"tune {pair} {cfg} FAILED {e!r}"[:500])
                RES["tune"].append(dict(cfg=cfg, pair=pair, err=repr(e)[:500]))
                continue
            RES["tune"].append(dict(cfg=cfg, pair=pair, ms=r["ms"], gbps=r["gbps"]))
            log(f"tune {pair} {cfg} {r['ms'] * 1e3:.1f} us {r['gbps']:.0f} GB/s")
            if best is None or r["ms"] < best[0]:
                best = (r["ms"], cfg)
        if best:
            TUNE_BEST[pair] = best[1]
    RES["tune_best"] = dict(TUNE_BEST)


@section("decode")
def decode_bench():
    ctxs = (4096, 16384, 65536, 131072)
    for ctx in ctxs:
        for kn, vn in (("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo3"),
                       ("f16", "f16")):
            r = bench_one(ctx, 1, kn, vn)  # library defaults: what a user gets
            r["floor_ms"] = r["bytes"] / RES.get("copy_gbps", 4300) / 1e6
            RES["decode"].append(r)
            log(f"decode ctx {ctx} {kn}/{vn}: {r['ms'] * 1e3:.1f} us, sdpa {r['ms_sdpa_f16'] * 1e3:.1f}"
                f" us, x{r['speedup']:.2f}, {r['gbps']:.0f} GB/s")


CASCADE_BEST: dict = {}


@section("tune_cascade")
def tune_cascade():
    cfgs = [(32, dict(impl="auto"))] + [(8, dict(impl="tile")), (8, dict(impl="auto"))]
    for n, cfg in cfgs:
        try:
            r = bench_one(65536, n, "q8_0", "turbo3", suffix=128, sdpa=False, tune=cfg)
        except Exception as e:  # noqa: BLE001
            log(f"tune cascade{n} {cfg} FAILED {e!r}"[:500])
            continue
        RES["tune"].append(dict(cascade=True, agents=n, cfg=cfg, ms=r["ms"], gbps=r["gbps"]))
        log(f"tune cascade{n} {cfg} {r['ms'] * 1e3:.1f} us (eager {r['ms_eager'] * 1e3:.1f})")


@section("cascade")
def cascade_bench():
    for n in (1, 8, 32, 64):
        r = bench_one(65536, n, "q8_0", "turbo3", suffix=128, tune=CASCADE_BEST)
        RES["cascade"].append(r)
        log(f"cascade {n} agents 64k: {r['ms'] * 1e3:.1f} us, sdpa x{n} {r['ms_sdpa_f16'] * 1e3:.1f}"
            f" us, dense cascade {r.get('ms_dense_cascade', float('nan')) * 1e3:.1f} us")


@section("quantize")
def quantize_bench():
    g = torch.Generator(device=DEV).manual_seed(1)
    rows = [(name, torch.float16) for name in ("f16", "q8_0", "q4_0", "turbo4", "turbo3")]
    rows.append(("turbo3", torch.bfloat16))  # bf16 rows: the two-dot (hi + lo) rotation
    for name, dt in rows:
        c = get_codec(name, 128)
        for B, T in ((1, 32768), (64, 1)):
            x = torch.randn(B, 8, T, 128, device=DEV, generator=g).to(dt)
            dst = c.empty((B, 8, T + 8), device=DEV)
            pos = torch.full((B,), 3, device=DEV)
            ms, ms_e = _time(lambda: quantize_into(dst, x, c, pos), 25, 100)
            ms_t = _median_ms(lambda: c.encode(x, check=False))
            out_bytes = (c.code_bytes + 2 * c.n_scales) * B * 8 * T
            moved = x.numel() * 2 + out_bytes
            if T > 1 and name != "f16":
                cfgs = (((64, 4, 4), (128, 4, 4), (128, 8, 2), (128, 8, 8), (256, 8, 4), (256, 16, 2))
                        if c.rotated
                        else ((16, 4, 0), (32, 4, 0), (64, 4, 0), (32, 4, 8)))
                for bt, w, pps in cfgs:
                    try:
                        m2, _ = _time(lambda: quantize_into(dst, x, c, pos, block_t=bt, num_warps=w,
                                                            programs_per_sm=pps), 25, 100)
                    except Exception as e:  # noqa: BLE001 - e.g. a tile over the shared memory
                        log(f"  quantize {name} {dt} block_t {bt} warps {w}: FAILED {e!r}"[:300])
                        continue
                    log(f"  quantize {name} {dt} block_t {bt} warps {w} programs/SM {pps}: "
                        f"{m2 * 1e3:.1f} us ({moved / m2 / 1e6:.0f} GB/s)")
                    RES["quantize"].append(dict(codec=name, dtype=str(dt), B=B, T=T, block_t=bt, num_warps=w,
                                                programs_per_sm=pps, ms=m2, gbps=moved / m2 / 1e6))
            r = dict(codec=name, dtype=str(dt), B=B, T=T, ms=ms, ms_eager=ms_e, ms_torch_encode=ms_t,
                     gbps=moved / ms / 1e6, rows_per_s=B * 8 * T / ms * 1e3)
            RES["quantize"].append(r)
            log(f"quantize {name} {dt} B{B} T{T}: {ms * 1e3:.1f} us ({r['gbps']:.0f} GB/s), "
                f"torch encode {ms_t * 1e3:.1f} us")
    # a decode step's K and V page writes (32 agents, one row each into a shared page pool):
    # one launch (quantize_kv_into) against two, bytes and time
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    G, rows = 32, 4096
    k, v = (torch.randn(G, 8, 1, 128, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.randperm(rows, device=DEV)[:G, None]

    def shared(p):
        return Packed(p.codes[None].expand(G, *p.codes.shape), p.scales[None].expand(G, *p.scales.shape))

    two = (kc.empty((8, rows), device=DEV), vc.empty((8, rows), device=DEV))
    one = (kc.empty((8, rows), device=DEV), vc.empty((8, rows), device=DEV))

    def apart():
        quantize_into(shared(two[0]), k, kc, pos)
        quantize_into(shared(two[1]), v, vc, pos)

    def paired():
        quantize_kv_into(shared(one[0]), k, kc, shared(one[1]), v, vc, pos)

    apart(), paired()
    same = all(torch.equal(a, b) for x, y in zip(one, two) for a, b in ((x.codes, y.codes), (x.scales, y.scales)))
    check("quantize K+V pair (q8_0/turbo3, 32 rows into pages) = two launches", same)
    ms2, _ = _time(apart, 25, 100)
    ms1, _ = _time(paired, 25, 100)
    RES["quantize"].append(dict(case="kv step write 32 agents", ms_two_launches=ms2, ms_one_launch=ms1))
    log(f"K+V step write, 32 agents: two launches {ms2 * 1e3:.1f} us, one {ms1 * 1e3:.1f} us")
    # with a recent window (R = 8): the page write inside the ring step's launch vs after it
    from polykv.kernels.dispatch import KVTarget, ring_step
    from polykv.pool.ring import AgentRings

    R, rq = 8, get_codec("q8_0", 128)
    seg_rows, ring_rows, *_ = AgentRings._indices(
        torch.arange(G, device=DEV), torch.full((G,), 100, device=DEV), torch.zeros(G, 1, dtype=torch.long,
                                                                                    device=DEV), -1, 1, R, R, G * R, DEV)
    rings = {m: (rq.empty((8, G * R + 1), device=DEV), rq.empty((8, G * R + 1), device=DEV)) for m in (1, 2)}
    real = torch.ones(G, 1, dtype=torch.bool, device=DEV)

    def target(pair):
        return KVTarget(shared(pair[0]), kc, shared(pair[1]), vc, pos)

    def ring_fused():
        return ring_step(*rings[1], k, v, ring_rows, seg_rows, real, pages=target(one))

    def ring_apart():
        seg = ring_step(*rings[2], k, v, ring_rows, seg_rows, real)
        target(two).write(k, v)
        return seg

    a, b = ring_fused(), ring_apart()
    same = all(torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales)
               for x, y in (*zip(a, b), *zip(one, two)))
    check("ring step + page write in one launch = apart (32 agents, R = 8)", same)
    ms1, _ = _time(ring_fused, 25, 100)
    ms2, _ = _time(ring_apart, 25, 100)
    RES["quantize"].append(dict(case="ring step + page write 32 agents", ms_two_launches=ms2,
                                ms_one_launch=ms1))
    log(f"ring step + page write, 32 agents: one launch {ms1 * 1e3:.1f} us, apart {ms2 * 1e3:.1f} us")
    # a prompt joining (n_q > spare + 1: the ring wraps within the step) against the reference
    from polykv.kernels.reference import ring_step_ref

    n_q, C = 32, R + 4
    lens = torch.randint(n_q, 400, (G,), device=DEV)
    real = torch.ones(G, n_q, dtype=torch.bool, device=DEV)
    real[::3, :5] = False  # left-padded agents
    page_rows = torch.where(real, 0, -1)
    seg_rows, ring_rows, *_ = AgentRings._indices(torch.randperm(G, device=DEV), lens, page_rows, -1, n_q, R, C,
                                                  G * C, DEV)
    kw, vw = (torch.randn(G, 8, n_q, 128, device=DEV, dtype=torch.float16) * 3 for _ in range(2))
    got_ring = (rq.encode(torch.randn(8, G * C + 1, 128, device=DEV)), rq.encode(torch.randn(8, G * C + 1, 128, device=DEV)))
    want_ring = tuple(Packed(p.codes.clone(), p.scales.clone()) for p in got_ring)
    # two joining agents' segments written by the same launch (a split step's wide agents)
    idx = torch.tensor([G - 1, 3], device=DEV)
    pos = torch.full((G,), -1, dtype=torch.long, device=DEV)
    pos[idx] = torch.arange(2, device=DEV)
    *got, wide_k, wide_v = ring_step(*got_ring, kw, vw, ring_rows, seg_rows, real, wraps=True, wide=(idx, pos))
    want = tuple(rq.empty((G, 8, R - 1 + n_q), device=DEV) for _ in range(2))
    ring_step_ref(*want_ring, kw, vw, ring_rows, seg_rows, real, *want)
    def held(t):  # a ring's rows but its scratch row (where padded columns land, in any order)
        return t[:, : G * C] if t.dim() == 3 else t

    same = all(torch.equal(held(a), held(b)) for x, y in (*zip(got, want), *zip(got_ring, want_ring))
               for a, b in ((x.codes, y.codes), (x.scales, y.scales)))
    same = same and all(torch.equal(w.codes, s.codes[idx]) and torch.equal(w.scales, s.scales[idx])
                        for w, s in ((wide_k, want[0]), (wide_v, want[1])))
    check("ring step of a 32-token feed (the ring wraps: R = 8, C = 12, 32 agents; two agents' "
          "segments also apart) = reference", same)


@section("window")
def window_bench():
    """Sliding-window layers' cascade (Gemma-3's local layers: 4 q heads / 1 KV head, head_dim 256,
    window 512) on the kernels vs the torch reference that served them before (issue G): checks
    at full size, then graph replays of both at 8 / 32 agents over a 32k shared prefix."""
    RES["window"] = []
    g = torch.Generator(device=DEV).manual_seed(11)

    def rnd(*s):
        return torch.randn(*s, device=DEV, generator=g, dtype=torch.float16)

    for kn, vn, hq, hkv, D, W in (("q8_0", "turbo3", 4, 1, 256, 512), ("q8_0", "turbo3", 32, 8, 128, 4096),
                                  ("turbo4", "turbo3", 4, 1, 256, 512)):
        kc, vc = get_codec(kn, D), get_codec(vn, D)
        P, S, N = 6000, W + 100, 5
        pk, pv = kc.encode(rnd(1, hkv, P, D)), vc.encode(rnd(1, hkv, P, D))
        sk, sv = kc.encode(rnd(N, hkv, S, D)), vc.encode(rnd(N, hkv, S, D))
        for n_q in (1, 4):
            # suffixes shorter than, about and longer than the window (each holds its n_q queries)
            lens = torch.tensor([n_q, 100, W - 1, W + 50, S], dtype=torch.int32, device=DEV)
            q = rnd(N, hq, n_q, D)
            kw = dict(window=W, prefix_start=100, prefix_end=100 + P)
            o, l = cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, **kw)
            o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, lens, kc, vc, **kw)
            fin = torch.isfinite(l2)
            check(f"window cascade {kn}/{vn} D{D} W{W} n_q{n_q}", rel(o, o2) <= 1e-2
                  and torch.equal(fin, torch.isfinite(l)), rel=rel(o, o2),
                  lse_err=(l[fin] - l2[fin]).abs().max().item())
            # with a recent window's segment (a pool layer with rings, R = 8): the third pass
            R = 8
            rc, w = get_codec("q8_0", D), R - 1 + n_q
            seg = RecentSegment(rc.encode(rnd(N, hkv, w, D)), rc.encode(rnd(N, hkv, w, D)), rc, R,
                                (w - lens).clamp(0, w).to(torch.int32))
            older = (lens - R).clamp_min(0)
            o, l = cascade_attention(q, pk, pv, sk, sv, older, kc, vc, recent=seg, **kw)
            o2, l2 = cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc, recent=seg, **kw)
            fin = torch.isfinite(l2)
            check(f"window cascade + recent {kn}/{vn} D{D} W{W} n_q{n_q}", rel(o, o2) <= 1e-2
                  and torch.equal(fin, torch.isfinite(l)), rel=rel(o, o2),
                  lse_err=(l[fin] - l2[fin]).abs().max().item())
    kc, vc = get_codec("q8_0", 256), get_codec("turbo3", 256)
    P, W = 32768, 512
    pk, pv = kc.encode(rnd(1, 1, P, 256)), vc.encode(rnd(1, 1, P, 256))
    for agents in (8, 32):
        sk, sv = kc.encode(rnd(agents, 1, 128, 256)), vc.encode(rnd(agents, 1, 128, 256))
        lens = torch.full((agents,), 128, dtype=torch.int32, device=DEV)
        q = rnd(agents, 4, 1, 256)
        ms, ms_eager = _time(lambda: cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, window=W), 10, 50)
        ms_ref, ms_ref_eager = _time(lambda: cascade_attention_ref(q, pk, pv, sk, sv, lens, kc, vc,
                                                                   window=W), 3, 10)
        r = dict(agents=agents, prefix=P, window=W, ms=ms, ms_eager=ms_eager, ms_ref=ms_ref,
                 ms_ref_eager=ms_ref_eager, speedup=ms_ref / ms)
        # with a recent window (R = 8, a decode step): the window as the cascade's third pass
        # (session 14) against the route it replaced — a prefix-only windowed cascade, the older
        # suffix rows' decode, the segment's decode and two LSE merges — in the same run
        R, rc = 8, get_codec("q8_0", 256)
        seg = RecentSegment(rc.encode(rnd(agents, 1, R, 256)), rc.encode(rnd(agents, 1, R, 256)), rc, R,
                            torch.zeros(agents, dtype=torch.int32, device=DEV))
        older = lens - R
        none = (slice(None), slice(None), slice(0, 0))

        def fused():
            return cascade_attention(q, pk, pv, sk, sv, older, kc, vc, window=W, recent=seg)

        def apart():
            o, l = cascade_attention(q, pk, pv, sk.index(none), sv.index(none), lens, kc, vc, window=W)
            o_s, l_s = attention_decode(q, sk, sv, kc, vc, kv_lens=older, window=W - R)
            o_r, l_r = attention_decode(q, seg.k, seg.v, rc, rc, window=R, kv_start=seg.kv_start)
            return merge_attention(*merge_attention(o, l, o_s, l_s), o_r, l_r)

        (o, _), (o2, _) = fused(), apart()
        check(f"window cascade + recent, fused = apart, {agents} agents", rel(o, o2) <= 1e-2, rel=rel(o, o2))
        r["ms_recent"], r["ms_recent_eager"] = _time(fused, 10, 50)
        r["ms_recent_apart"], r["ms_recent_apart_eager"] = _time(apart, 10, 50)
        RES["window"].append(r)
        log(r)


def table():
    lines = [f"GPU {RES.get('env', {}).get('gpu')}  copy {RES.get('copy_gbps', 0):.0f} GB/s  "
             f"tune {RES.get('tune_best')}"]
    bad = [c["name"] for c in RES["checks"] if not c["ok"]]
    lines.append(f"checks: {sum(c['ok'] for c in RES['checks'])}/{len(RES['checks'])} ok"
                 + (f"  FAILED: {bad}" if bad else ""))
    lines.append("decode (1 agent, 32q/8kv/128):")
    lines.append(f"{'ctx':>7} {'K/V':>14} {'us':>8} {'sdpa_us':>8} {'x':>6} {'GB/s':>6} "
                 f"{'%copy':>6} {'floor_us':>8} {'eager_us':>8} {'sdpa_eager':>10}")
    for r in RES["decode"]:
        lines.append(f"{r['ctx']:>7} {r['k'] + '/' + r['v']:>14} {r['ms'] * 1e3:>8.1f} "
                     f"{r['ms_sdpa_f16'] * 1e3:>8.1f} {r['speedup']:>6.2f} {r['gbps']:>6.0f} "
                     f"{100 * r['gbps'] / RES.get('copy_gbps', 4300):>6.0f} "
                     f"{r['floor_ms'] * 1e3:>8.1f} {r['ms_eager'] * 1e3:>8.1f} "
                     f"{r['ms_sdpa_f16_eager'] * 1e3:>10.1f}")
    lines.append("cascade (64k shared prefix q8_0/turbo3 + 128-token suffixes):")
    for r in RES["cascade"]:
        dc = r.get("ms_dense_cascade")
        dcs = f"dense cascade {dc * 1e3:>7.1f} us x{dc / r['ms']:.2f}  " if dc else ""
        lines.append(f"  agents {r['agents']:>3}: {r['ms'] * 1e3:>8.1f} us  {dcs}sdpa(N dense) "
                     f"{r['ms_sdpa_f16'] * 1e3:>9.1f} us  x{r['speedup']:.1f}  {r['gbps']:.0f} GB/s  "
                     f"(eager {r['ms_eager'] * 1e3:.1f} / {r['ms_sdpa_f16_eager'] * 1e3:.1f} us)")
    if RES.get("window"):
        lines.append("sliding-window cascade (Gemma-3 local layer: 4q/1kv/256, window 512, 32k prefix):")
        for r in RES["window"]:
            lines.append(f"  agents {r['agents']:>3}: {r['ms'] * 1e3:>8.1f} us  torch reference "
                         f"{r['ms_ref'] * 1e3:>8.1f} us  x{r['speedup']:.1f}  (eager {r['ms_eager'] * 1e3:.1f}"
                         f" / {r['ms_ref_eager'] * 1e3:.1f} us)")
            if "ms_recent" in r:
                lines.append(f"    + recent window R=8: third pass {r['ms_recent'] * 1e3:.1f} us, apart "
                             f"{r['ms_recent_apart'] * 1e3:.1f} us (eager {r['ms_recent_eager'] * 1e3:.1f}"
                             f" / {r['ms_recent_apart_eager'] * 1e3:.1f} us)")
    lines.append("quantize-on-write:")
    for r in RES["quantize"]:
        if "case" in r:
            lines.append(f"  {r['case']}: one launch {r['ms_one_launch'] * 1e3:.1f} us, two "
                         f"{r['ms_two_launches'] * 1e3:.1f} us")
            continue
        if "block_t" in r:
            continue
        lines.append(f"  {r['codec']:>7} B{r['B']:>3} T{r['T']:>6}: {r['ms'] * 1e3:>8.1f} us "
                     f"{r['gbps']:>6.0f} GB/s  (torch encode {r['ms_torch_encode'] * 1e3:.1f} us)")
    txt = "\n".join(lines)
    RES["table"] = txt
    save()
    print("\n" + txt, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("POLYKV_CACHE_DIR", "/tmp/polykv_cache")
    t0 = time.time()
    env()
    correctness()
    correctness_heads()
    tune()
    decode_bench()
    tune_cascade()
    cascade_bench()
    quantize_bench()
    window_bench()
    log(f"total {time.time() - t0:.0f}s")
    table()
