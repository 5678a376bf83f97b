"""The cascade at SmolLM2-135M's attention shape (3 KV / 9 q heads, head_dim 64) with a verify step's
query columns (issue I): how the prefix pass's row tile and keys per split set its time (GPU).

A verify step of w drafts gives each KV head agents x 3 x (w + 1) query rows; at head_dim 64 the
prefix pass is the tile kernel (`triton_decode._decode_kernel`, 64-row tiles by default), and every
row tile decodes its split's keys again (BENCHMARKS §8.10). Per prefix length and query columns
n_q, each config (row tile `prefix_block_m`, warps, keys per split) is timed as one cascade call —
CUDA-graph replay median, suffixes of 40 rows — and checked against `cascade_attention_ref`.

    PYTHONPATH=. python3 polykv/bench/prefix_tile.py [--agents 32] [--ctx 2048,16384] [--n-q 1,2,3,5]
        [--configs 32x4,64x4,128x4,128x8]   # row tile x warps [x keys per split]

Since kernels_notes v21 / v22 a 64-row tile whose planned splits would hold one or two key tiles
takes 32-row tiles: give that split (`64x4x64` for the 2k prefix at n_q 1–3, `64x4x128` at n_q 5)
to time the 64-row plan of BENCHMARKS §5.18 (which predates the rule).

Writes prefix_tile.json under --out: {"P<ctx>_nq<n_q>_bm<tile>_nw<warps>[_sl<split>]": {us, rel}}.
`device="cpu"` (the smoke test): the interpreter, no timing.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

HKV, GROUP, D = 3, 3, 64


def parse_config(s: str) -> tuple[int, int, int | None]:
    """"64x4" -> (64, 4, None); "64x4x256" -> (64, 4, 256): row tile, warps, keys per split."""
    parts = [int(x) for x in s.split("x")]
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None


def run(agents: int = 32, ctxs=(2048, 16384), n_qs=(1, 2, 3, 5),
        configs=((32, 4, None), (64, 4, None), (128, 4, None), (128, 8, None)),
        device: str = "cuda", log=print) -> dict:
    from polykv.codecs import get_codec
    from polykv.kernels.dispatch import cascade_attention
    from polykv.kernels.reference import cascade_attention_ref

    cuda = device == "cuda"
    if cuda:
        from polykv.bench.attention import _median_ms, graphed

        torch.backends.cuda.enable_cudnn_sdp(False)
    kc, vc = get_codec("q8_0", D), get_codec("turbo3", D)
    res = {}
    for P in ctxs:
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, device=device, generator=g)

        pk, pv = kc.encode(rnd(1, HKV, P, D)), vc.encode(rnd(1, HKV, P, D))
        sk, sv = kc.encode(rnd(agents, HKV, 64, D)), vc.encode(rnd(agents, HKV, 64, D))
        lens = torch.full((agents,), 40, dtype=torch.int32, device=device)
        for n_q in n_qs:
            q = rnd(agents, HKV * GROUP, n_q, D).to(torch.bfloat16 if cuda else torch.float16)
            ref, _ = cascade_attention_ref(q, pk, pv, sk, sv, lens, kc, vc)
            for bm, nw, split in configs:
                if split and split * 2 > P:
                    continue
                tune = dict(prefix_block_m=bm,
                            prefix_tune={"num_warps": nw, **({"split_len": split} if split else {})})
                name = f"P{P}_nq{n_q}_bm{bm}_nw{nw}" + (f"_sl{split}" if split else "")

                def call():
                    return cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, **tune)

                try:
                    out, _ = call()
                    rel = float((out.double() - ref.double()).norm() / ref.double().norm())
                    us = _median_ms(graphed(call), 10, 100) * 1e3 if cuda else None
                except Exception as e:  # noqa: BLE001 - a config that does not build is a result too
                    res[name] = dict(error=repr(e)[:200])
                    log(f"{name}: {e!r}"[:200])
                    continue
                res[name] = dict(us=None if us is None else round(us, 2), rel=rel)
                log(f"P {P:6d} n_q {n_q} rows/KV head {agents * GROUP * n_q:4d} tile {bm:3d} warps {nw} "
                    f"split {str(split):>4}: " + (f"{us:7.1f} us" if cuda else "") + f"  rel {rel:.2e}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--ctx", default="2048,16384")
    ap.add_argument("--n-q", default="1,2,3,5")
    ap.add_argument("--configs", default="32x4,64x4,128x4,128x8")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = run(a.agents, [int(x) for x in a.ctx.split(",")], [int(x) for x in a.n_q.split(",")],
              [parse_config(c) for c in a.configs.split(",")])
    with open(os.path.join(a.out, "prefix_tile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
