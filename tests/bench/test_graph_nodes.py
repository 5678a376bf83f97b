"""`graph_launch.graph_nodes`: the node census of a CUDA graph's DOT dump (verify_profile
--graph-nodes), parsed here from a dump in CUDA's shape (record labels over several lines)."""

from polykv.bench.graph_launch import graph_nodes

DOT = '''digraph dot {
subgraph cluster_1 {
label="graph_1" graph[style="dashed"];
"graph_1_node_0"[style="solid" shape="record" label="{KERNEL
| {ID | 0 | _Z21_phase_decode_kernelPvS_}
}"];
"graph_1_node_1"[style="solid" shape="record" label="{MEMSET | {ID | 1 | value 0}}"];
"graph_1_node_2"[style="solid" shape="record" label="{KERNEL | {ID | 2 | nvjet_sm90_tst_64x8_h}}"];
"graph_1_node_3"[style="solid" shape="record" label="{EVENT_RECORD | {ID | 3}}"];
"graph_1_node_0" -> "graph_1_node_1" [style="dashed"];
"graph_1_node_1" -> "graph_1_node_2";
"graph_1_node_2" -> "graph_1_node_3";
}
}
'''


class _Dumped:
    def debug_dump(self, path):
        with open(path, "w") as f:
            f.write(DOT)


def test_graph_nodes_counts_types_edges_and_kernels():
    c = graph_nodes(_Dumped())
    assert c["nodes"] == {"KERNEL": 2, "MEMSET": 1, "EVENT_RECORD": 1}
    assert c["edges"] == 3 and c["edge_styles"] == {"dashed": 1, "plain": 2}
    assert c["kernels"] == {"_Z21_phase_decode_kernelPvS_": 1, "nvjet_sm90_tst_64x8_h": 1}


def test_debug_graphs_keeps_every_graph(monkeypatch):
    """`debug_graphs` makes every later torch.cuda.CUDAGraph() a kept graph (keep_graph=True) in
    debug mode: the binding builds the C++ graph from __init__'s arguments, so a keep_graph given
    only to __new__ is lost (session 24's census read empty dumps)."""
    import torch

    from polykv.bench import graph_launch

    made = []

    class Binding:  # stands in for torch's CUDAGraph (no CUDA here)
        def __new__(cls, keep_graph=False):
            return object.__new__(cls)

        def __init__(self, keep_graph=False):
            made.append(["keep" if keep_graph else "drop"])

        def enable_debug_mode(self):
            made[-1].append("debug")

    monkeypatch.setattr(torch.cuda.graphs, "CUDAGraph", Binding)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Binding)
    graph_launch.debug_graphs()
    torch.cuda.CUDAGraph()
    torch.cuda.CUDAGraph(keep_graph=False)
    assert made == [["keep", "debug"], ["keep", "debug"]]


def test_replay_host_ms_times_the_call_alone():
    """`replay_host_ms`: the median of the replay call's own time, the wait (sync) outside it."""
    import time

    from polykv.bench import graph_launch

    calls = []

    class Slow:
        def replay(self):
            calls.append("replay")
            time.sleep(0.004)

    ms = graph_launch.replay_host_ms(Slow(), reps=5, sync=lambda: (calls.append("sync"), time.sleep(0.02)))
    assert 4 <= ms < 15  # the 20 ms waits are not in it
    assert calls == ["sync", "replay"] * 5 + ["sync"]
