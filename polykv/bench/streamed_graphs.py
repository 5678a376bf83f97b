"""Probe (GPU): decode steps over a host-tier (streamed) document, captured in CUDA graphs vs eager, at
three chunk sizes, beside the GPU-resident captured step — the figures of docs/BENCHMARKS.md §9
("What made it") and docs/pool.md. Random-initialised Llama-3-8B-shape model, 4 layers, bf16, a
64k-token document, K q8_0 / V turbo3, median of 8 steps after 2 warm-ups.

    PYTHONPATH=. POLYKV_CACHE_DIR=.pkvcache python3 polykv/bench/streamed_graphs.py

Prints each row and the torch.profiler table of one 8-agent captured step; writes $OUT/probe.json
(or ./probe.json): {tag: {ms, ms_gpu, ms_min, ms_max, steps, toks}}.
"""

from __future__ import annotations

import json
import os

import torch

from polykv.bench.e2e import Clock, build_model, greedy_steps, use_attention
from polykv.pool import SharedKVPool


def main() -> dict:
    dev = torch.device("cuda")
    clock = Clock(dev)
    model = build_model(4, dev, torch.bfloat16)
    use_attention(model, "polykv")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (65536,), generator=g).tolist()
    sfx = torch.randint(0, model.config.vocab_size, (32, 64), generator=g).tolist()
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, prefill_chunk=4096,
                        host_budget_bytes=1 << 62, stream_chunk_rows=16384)
    doc = pool.add_document(ids)
    res: dict = {}

    def run(tag: str, n: int, graphs: bool = True, prof: bool = False) -> None:
        with pool.open_batch(doc, capacity=n, seq_capacity=100, promote=False, graphs=graphs) as b:
            for s in sfx[:n]:
                b.add(s)
            r = greedy_steps(clock, b)
            step = r.pop("step")
            res[tag] = r
            print(tag, {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}, flush=True)
            if prof:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    step()
                    torch.cuda.synchronize()
                print(p.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=40))

    run("gpu_graph_8", 8)
    for rows in (16384, 65536, 4096):  # re-chunk: back to the GPU, then to the host in `rows`-row chunks
        pool.move(doc, "gpu")
        pool.stream_chunk_rows = rows
        pool.move(doc, "host")
        for n in (1, 8, 32):
            run(f"host_{rows}_{n}_graph", n, prof=(rows == 16384 and n == 8))
        run(f"host_{rows}_8_eager", 8, graphs=False)
        print("same tokens graph vs eager:", res[f"host_{rows}_8_graph"]["toks"] == res[f"host_{rows}_8_eager"]["toks"])
    with open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
