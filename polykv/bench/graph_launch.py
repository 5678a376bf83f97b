"""Host time of one CUDA graph launch (`CUDAGraph.replay`) for a graph of bf16 linears of
SmolLM2-135M's widths (30 layers x q, k, v, o, gate, up, down), by the rows M each linear multiplies:
does the GEMM kernel cuBLAS picks per M change what launching the graph costs the host?

    PYTHONPATH=. python3 polykv/bench/graph_launch.py [--rows 8,16,24,32,64,96,128]

Why (BENCHMARKS §8.14): a verify step's graph (agents x (drafts + 1) query rows) took 0.45-0.49 ms of
host time per replay on an H100 against 0.12-0.17 ms for a plain step's (agents rows), though both
hold about the same number of kernels. Per M: the median host time of `replay()` (no sync) and of
replay + sync over 50 launches, and the GEMM kernels the graph holds (profiled). CUDA only. Writes
graph_launch.json under $OUT (or --out).

`debug_graphs()` / `graph_nodes()`: the census of a captured graph's nodes (by type, its edges, its
kernels by name) from CUDA's DOT dump, and `replay_host_ms()`: one graph's launch alone, for
comparing graphs whose launches cost differently (`verify_profile.py --graph-nodes`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from collections import Counter

import torch

# (out, in) of one SmolLM2-135M layer's linears: q, k, v, o, gate, up, down
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def launch_times(rows: int, layers: int = 30, launches: int = 60) -> dict:
    """{host_ms, wall_ms, kernels} of a captured graph of `layers` x SHAPES linears at `rows` rows."""
    from torch.profiler import ProfilerActivity, profile

    from polykv.bench.attention import graphed

    dev = "cuda"
    weights = [[torch.randn(o, i, device=dev, dtype=torch.bfloat16) for o, i in SHAPES] for _ in range(layers)]
    x = {i: torch.randn(rows, i, device=dev, dtype=torch.bfloat16) for i in {i for _, i in SHAPES}}

    def body():
        for layer in weights:
            for w in layer:
                torch.nn.functional.linear(x[w.shape[1]], w)

    replay = graphed(body)  # warmed up on a side stream: cuBLAS settled before the capture
    host = []
    for _ in range(launches):
        t0 = time.perf_counter()
        replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((time.perf_counter(), t1, t0))
    host_ms = [(t1 - t0) * 1e3 for _, t1, t0 in host[10:]]
    wall_ms = [(t2 - t0) * 1e3 for t2, _, t0 in host[10:]]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return dict(host_ms=statistics.median(host_ms), wall_ms=statistics.median(wall_ms), kernels=kernels)


NODE_TYPES = ("KERNEL", "MEMCPY", "MEMSET", "HOST", "GRAPH", "EMPTY", "WAIT_EVENT", "EVENT_RECORD",
              "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT", "MEM_ALLOC", "MEM_FREE", "BATCH_MEM_OP", "CONDITIONAL")


def debug_graphs() -> None:
    """From now on (for the rest of the process) every `torch.cuda.CUDAGraph()` keeps its graph for
    `graph_nodes`: constructed with keep_graph=True (the cudaGraph_t is kept beside the executable
    one, instantiated at the first replay) and in debug mode. Debug mode alone left `debug_dump`
    an empty file on torch 2.11 (session 24's census: no node read)."""

    class Kept(torch.cuda.graphs.CUDAGraph):
        # torch's __new__ forwards its argument to the binding's allocation only: the C++ graph
        # is built by the binding's __init__, which takes the constructor's arguments
        def __init__(self, keep_graph: bool = False):
            super().__init__(True)
            self.enable_debug_mode()

    torch.cuda.CUDAGraph = Kept


def replay_host_ms(graph, reps: int = 20, sync=None) -> float:
    """Median host time (ms) of one `graph.replay()` call, the device idle before each (sync: the
    wait, default torch.cuda.synchronize). A replay reruns the step on its last inputs: for timing
    runs only."""
    sync = torch.cuda.synchronize if sync is None else sync
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        graph.replay()
        out.append(time.perf_counter() - t)
    sync()
    return statistics.median(out) * 1e3


def _statements(dot: str) -> list[str]:
    """The DOT text's statements: a node's attribute list may span lines (CUDA's record labels)."""
    out, cur = [], []
    for line in dot.splitlines():
        cur.append(line)
        if line.rstrip().endswith(("]", "];")) or "[" not in "".join(cur):
            out.append("\n".join(cur))
            cur = []
    return out + (["\n".join(cur)] if cur else [])


def graph_nodes(graph) -> dict:
    """{nodes: {type: count}, edges, edge_styles, kernels: {name: count} (the 25 most frequent),
    dot_head} of a graph captured in debug mode, from `CUDAGraph.debug_dump`'s DOT text."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        graph.debug_dump(f.name)
        dot = open(f.name, encoding="utf-8", errors="replace").read()
    nodes, styles, kernels = Counter(), Counter(), Counter()
    for stmt in _statements(dot):
        if "->" in stmt:
            styles[(re.search(r'style="?(\w+)', stmt) or [None, "plain"])[1]] += 1
        elif re.match(r'\s*"[^"]+"\s*\[', stmt):  # a node (not a cluster's own label)
            kind = next((t for t in NODE_TYPES if re.search(rf"\b{t}\b", stmt)), "OTHER")
            nodes[kind] += 1
            if kind == "KERNEL":
                name = re.search(r"(_Z\w+|nvjet\w+|triton_\w+|_\w+_kernel\w*)", stmt)
                kernels[name[1][:80] if name else "?"] += 1
    return dict(nodes=dict(nodes), edges=sum(styles.values()), edge_styles=dict(styles),
                kernels=dict(kernels.most_common(25)), dot_head=dot[:1500])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,24,32,64,96,128")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py needs CUDA")
    res = {}
    for m in (int(r) for r in a.rows.split(",") if r):
        res[m] = launch_times(m)
        print(f"M {m:4d}: replay host {res[m]['host_ms']:.3f} ms, replay + sync {res[m]['wall_ms']:.3f} ms, "
              f"kernels {[k[:40] for k in res[m]['kernels']]}")
    res = dict(rows=res, device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    with open(os.path.join(a.out, "graph_launch.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
