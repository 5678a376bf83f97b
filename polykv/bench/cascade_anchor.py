"""The cascade at 64k against its anchors, one short GPU run: N agents (8, 32, 64) over a 65,536-row
q8_0 / turbo3 prefix with 128-token private suffixes (`cascade_attention`, default tuning) beside the
fp16 dense cascade (`bench.attention.dense_cascade`), and one sequence's decode beside torch SDPA
fp16 — CUDA-graph replays and eager calls, the rows of `bench.attention.bench_one`.

    PYTHONPATH=. python3 polykv/bench/cascade_anchor.py

Prints one line per case; writes cascade_anchor.json under $OUT (or .). The GPU suite
(`gpu_suite.py`) times the same cases among many more; this is the quick loop for a kernel change.
"""

from __future__ import annotations

import json
import os

import torch

from polykv.bench.attention import bench_one


def main() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)  # it rebuilds its plan every decode call
    rows = []
    for n in (8, 32, 64):
        r = bench_one(65536, n, "q8_0", "turbo3", suffix=128, sdpa=True)
        rows.append(r)
        print(f"cascade {n} agents 64k: {r['ms'] * 1e3:.1f} us (eager {r['ms_eager'] * 1e3:.1f}), "
              f"dense cascade {r['ms_dense_cascade'] * 1e3:.1f} us, x{r['ms_dense_cascade'] / r['ms']:.2f}",
              flush=True)
    r = bench_one(65536, 1, "q8_0", "turbo3", suffix=0, sdpa=True)
    rows.append(r)
    print(f"decode 1 seq 64k: {r['ms'] * 1e3:.1f} us (eager {r['ms_eager'] * 1e3:.1f}), "
          f"sdpa {r['ms_sdpa_f16'] * 1e3:.1f} us, x{r['ms_sdpa_f16'] / r['ms']:.2f}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "cascade_anchor.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
