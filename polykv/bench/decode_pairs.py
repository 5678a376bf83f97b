"""Decode of one sequence for several K x V pairs against torch SDPA fp16, one short GPU run, with a
check of each pair against the torch reference (InnerQ scales on K where K is turbo) — the quick loop
for a change to the decode path (the GPU suite times and checks the same among many more).

    PYTHONPATH=. python3 polykv/bench/decode_pairs.py [--ctx 4096,16384,65536] [--pairs q8_0/turbo3,q4_0/turbo3]

Prints one line per (ctx, pair); writes decode_pairs.json under $OUT (or .).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from polykv.bench.attention import bench_one

PAIRS = (("q8_0", "turbo3"), ("turbo4", "turbo3"), ("turbo3", "turbo3"))


def check(kname: str, vname: str, ctx: int = 4099, tune: dict | None = None) -> float:
    """rel. error of attention_decode (tuning keywords `tune`) vs attention_decode_ref (K
    InnerQ-scaled when rotated)."""
    from polykv.codecs import get_codec
    from polykv.kernels import attention_decode, attention_decode_ref

    g = torch.Generator(device="cuda").manual_seed(5)
    kc, vc = get_codec(kname, 128), get_codec(vname, 128)
    s = (torch.rand(8, 128, device="cuda", generator=g) + 0.5) if kc.rotated else None
    k = torch.randn(2, 8, ctx, 128, device="cuda", generator=g)
    kp = kc.encode(k * s[None, :, None, :] if s is not None else k)
    vp = vc.encode(torch.randn(2, 8, ctx, 128, device="cuda", generator=g))
    q = torch.randn(2, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    out, _ = attention_decode(q, kp, vp, kc, vc, k_innerq=s, **(tune or {}))
    ref, _ = attention_decode_ref(q, kp, vp, kc, vc, k_innerq=s)
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="4096,16384,65536")
    ap.add_argument("--pairs", default=",".join(f"{k}/{v}" for k, v in PAIRS), help="K/V pairs, comma-separated")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
    torch.backends.cuda.enable_cudnn_sdp(False)  # it rebuilds its plan every decode call
    rows = []
    for kn, vn in pairs:
        err = check(kn, vn)
        rows.append(dict(k=kn, v=vn, rel_err=err))
        print(f"check {kn}/{vn}: rel. error {err:.2e}", flush=True)
    for ctx in (int(c) for c in args.ctx.split(",")):
        for kn, vn in pairs:
            r = bench_one(ctx, 1, kn, vn, sdpa=True)
            rows.append(r)
            print(f"decode {ctx} {kn}/{vn}: {r['ms'] * 1e3:.1f} us (eager {r['ms_eager'] * 1e3:.1f}), "
                  f"sdpa {r['ms_sdpa_f16'] * 1e3:.1f} us, x{r['ms_sdpa_f16'] / r['ms']:.2f}", flush=True)
    with open(os.path.join(args.out, "decode_pairs.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
