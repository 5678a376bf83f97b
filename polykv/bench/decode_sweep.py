"""Sweep launch configurations of one sequence's decode (`attention_decode` tuning keywords) at a few
context lengths (GPU): CUDA-graph replay time per config, SDPA fp16 once per length, and each
config's output checked against the torch reference (decode_pairs.check: rel. error).

    PYTHONPATH=. python3 polykv/bench/decode_sweep.py [--ctx 65536,16384] [--k q8_0 --v turbo3] [--configs JSON]

JSON configs: a list of keyword dicts, e.g. '[{}, {"num_stages": 3}, {"target_programs": 1320}]'.
Writes decode_sweep.json under $OUT (or .).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from polykv.bench.attention import bench_one
from polykv.bench.decode_pairs import check


def default_configs(sms: int) -> list[dict]:
    """The defaults first, then the knobs the v7 and v13 sweeps moved (kernels_notes.md)."""
    return [{}, {"num_stages": 3}, {"target_programs": sms * 6}, {"target_programs": sms * 10},
            {"target_programs": sms * 12}, {"block_n": 128}, {"num_warps": 2},
            {"block_n": 32, "target_programs": sms * 12}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="65536,16384")
    ap.add_argument("--k", default="q8_0")
    ap.add_argument("--v", default="turbo3")
    ap.add_argument("--configs", default=None, help="JSON list of tuning dicts (default: a built-in sweep)")
    a = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)  # it rebuilds its plan every decode call
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = json.loads(a.configs) if a.configs else default_configs(sms)
    rows = []
    for ctx in map(int, a.ctx.split(",")):
        for i, tune in enumerate(configs):
            try:
                r = bench_one(ctx, 1, a.k, a.v, tune=tune, sdpa=i == 0)
                r.update(tune=tune, rel_err=check(a.k, a.v, tune=tune))
            except Exception as e:  # a config that does not build: say so, go on
                r = dict(ctx=ctx, tune=tune, error=f"{type(e).__name__}: {e}"[:300])
            rows.append(r)
            sdpa = f", sdpa {r['ms_sdpa_f16'] * 1e3:.1f} us" if r.get("ms_sdpa_f16") else ""
            print(f"{ctx} {tune}: " + (f"{r['ms'] * 1e3:.1f} us, rel {r['rel_err']:.2e}{sdpa}"
                                       if "ms" in r else r["error"]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
