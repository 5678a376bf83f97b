"""Sweep launch configurations of the cascade (shared compressed prefix + per-agent suffixes) at one
context length (GPU): CUDA-graph replay time per config and agent count, best first.

    PYTHONPATH=. python3 polykv/bench/cascade_sweep.py [--ctx 32768] [--agents 8,32,64]

Writes cascade_sweep.json under $OUT (or .).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from polykv.bench.attention import bench_one

CONFIGS = [
    {},  # the defaults
    dict(prefix_block_m=128, num_warps=8),
    dict(prefix_block_m=64, block_n=128),
    dict(prefix_block_m=64, num_stages=3),
    dict(prefix_block_m=32),
    dict(prefix_block_m=64, target_programs_mult=2),
    dict(prefix_block_m=64, target_programs_mult=0.5),
    dict(prefix_block_m=128, num_warps=4, block_n=32),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--agents", default="8,32,64")
    ap.add_argument("--k", default="q8_0")
    ap.add_argument("--v", default="turbo3")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for n in [int(a) for a in args.agents.split(",")]:
        for cfg in CONFIGS:
            tune = dict(cfg)
            mult = tune.pop("target_programs_mult", None)
            if mult:
                from polykv.kernels.triton_decode import num_programs_target

                tune["target_programs"] = int(num_programs_target(torch.device("cuda")) * mult)
            try:
                r = bench_one(args.ctx, n, args.k, args.v, suffix=64, sdpa=False, tune=tune)
            except Exception as e:  # noqa: BLE001 - a config that does not build is a result too
                rows.append(dict(agents=n, cfg=cfg, error=repr(e)[:300]))
                continue
            rows.append(dict(agents=n, cfg=cfg, us=r["ms"] * 1e3))
            print(f"agents {n:3d} {str(cfg):60s} {r['ms'] * 1e3:8.1f} us", flush=True)
    with open(os.path.join(args.out, "cascade_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for n in sorted({r["agents"] for r in rows}):
        ok = sorted((r for r in rows if r["agents"] == n and "us" in r), key=lambda r: r["us"])
        print(f"best @{n} agents: {ok[0]['cfg']} {ok[0]['us']:.1f} us (default "
              f"{next(r['us'] for r in rows if r['agents'] == n and r['cfg'] == {} and 'us' in r):.1f})")


if __name__ == "__main__":
    main()
