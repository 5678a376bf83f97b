"""Where a pool decode step spends its time (GPU): torch.profiler over a few steps of N agents over
one document, eager and graph-replayed, on a random-initialised Llama-3-8B-shape model.

    PYTHONPATH=. python3 polykv/bench/step_profile.py [--agents 32] [--ctx 32768] [--layers 4]

Prints wall time per step and the top device kernels by total time; writes step_profile.json under
$OUT (or .).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def top_kernels(prof, steps: int, n: int = 20) -> tuple[float, list]:
    """(device ms per step, the n kernels of most device time: name, ms and calls per step) of a
    torch.profiler run over `steps` steps."""
    ka = prof.key_averages()
    dev = sorted((e for e in ka if getattr(e, "device_time_total", 0) > 0), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in dev if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / 1e3 / steps, [{"name": e.key[:90], "ms_per_step": e.device_time_total / 1e3 / steps,
                                  "calls_per_step": e.count / steps} for e in dev[:n]]


def main() -> None:
    from polykv.bench.gpu_integration import build_model
    from polykv.pool import SharedKVPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile", action="store_true",
                    help="also profile graphs whose norms and MLPs are compiled (the CUDA default: "
                         "hf.graphs.capture_step); without it, captured steps run them eagerly")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False)
    doc = pool.add_document(torch.randint(0, 32000, (args.ctx,), generator=g).tolist())
    res = {}
    modes = [(False, False), (True, False)] + ([(True, True)] if args.compile else [])
    from polykv.hf import graphs as hf_graphs

    for graphs, compiled in modes:
        pool.close()  # a parked batch keeps its captured steps: each mode captures its own
        hf_graphs.COMPILE = compiled
        with torch.inference_mode(), pool.open_batch(doc, capacity=args.agents, seq_capacity=64 + 3 * args.steps + 8,
                                                     graphs=graphs) as b:
            aids = [b.add(torch.randint(0, 32000, (64,), generator=g).tolist()) for _ in range(args.agents)]
            toks = b.step_tokens()
            for _ in range(args.steps):  # warm-up (graph capture)
                b.feed(toks)
                toks = b.step_tokens()
            torch.cuda.synchronize()
            walls = []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    b.feed(toks)
                    toks = b.step_tokens()
                    walls.append((time.perf_counter() - t0) * 1e3)
            del aids
        device_ms, top = top_kernels(prof, args.steps, 25)
        name = ("graph+compile" if compiled else "graph") if graphs else "eager"
        res[name] = {"ms_wall_median": sorted(walls)[len(walls) // 2], "device_ms_per_step": device_ms,
                     "top": top}
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    for name, r in res.items():
        print(f"== {name}: wall {r['ms_wall_median']:.3f} ms/step, device {r['device_ms_per_step']:.3f} ms/step")
        for t in r["top"][:14]:
            print(f"  {t['ms_per_step']:8.3f} ms  x{t['calls_per_step']:5.1f}  {t['name']}")


if __name__ == "__main__":
    main()
