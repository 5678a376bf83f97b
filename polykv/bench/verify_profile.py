"""What a verify step costs against a plain decode step (issue I), and where the difference goes.

    PYTHONPATH=. python3 polykv/bench/verify_profile.py [--agents 32] [--ctx 2048] [--widths 0,1,2,4]

On the H200 a verify step of 2-4 drafts took 5.9-7.1 ms against 4.7-5.1 ms for a plain step at 32
agents (SmolLM2, BENCHMARKS §8.7), though it runs the same kernels: the interpreter counts the same
Triton launches for both and 5-9 more torch ops (session 18). So some kernels take longer with the
verify's query rows (agents x q heads x (width + 1) per KV head). This bench measures it: a
random-initialised model of SmolLM2-135M's shape (30 layers, 9 q / 3 KV heads, head_dim 64, bf16 on
CUDA; timing does not depend on trained weights), one document of `ctx` random tokens, K q8_0 / V
turbo3 with the default recent window, `agents` agents in one batch with captured steps. Per width
w (0: a plain step; w > 0: every agent feeds its token and w drafts, which the random model
rejects, so every step is a full-width verify and its rollback): the median wall time of `steps`
steps (synchronised: host work included) split into the host's feed, launch (until the step is
queued) and result (the wait for the device plus the host half: acceptance, rollback); the host's
Python functions by own time (cProfile); and, profiled, the device time per step and its top
kernels. Writes verify_profile.json under --out.

On the CPU (`--device cpu`; the smoke test): eager steps, no device profile, a 512-token vocabulary
(the host's part of a step at the real layer count, e.g. `--device cpu --agents 32 --ctx 256
--widths 0,1,4 --steps 3`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch


def smollm2_shape(device, dtype=torch.bfloat16, layers: int = 30, vocab: int = 49152):
    """Random-initialised LlamaForCausalLM with SmolLM2-135M's shape (heads, head_dim, widths), of
    `layers` layers and a `vocab`-token vocabulary (the CPU runs take a small one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      vocab_size=vocab, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def device_ops(prof, steps: int) -> dict:
    """{kernels, memcpy, memset}: device operations per step of a torch.profiler run (what a
    captured step's graph holds as nodes, dependencies aside)."""
    out = {"kernels": 0, "memcpy": 0, "memset": 0}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and getattr(e, "device_time_total", 0) > 0:
            kind = "memcpy" if e.key.startswith("Memcpy") else "memset" if e.key.startswith("Memset") else "kernels"
            out[kind] += e.count
    return {k: round(v / steps, 1) for k, v in out.items()}


def _host_top(prof: cProfile.Profile, steps: int, n: int = 15) -> list[dict]:
    """The n functions with the most time of their own (waits included), ms per step."""
    st = pstats.Stats(prof).stats  # {(file, line, name): (calls, ncalls, tottime, cumtime, callers)}
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:n]
    return [dict(name=f"{os.path.basename(f)}:{line}({fn})", calls_per_step=round(v[1] / steps, 1),
                 ms_own_per_step=round(v[2] * 1e3 / steps, 3), ms_cum_per_step=round(v[3] * 1e3 / steps, 3))
            for (f, line, fn), v in top]


def run(agents: int = 32, ctx: int = 2048, widths=(0, 1, 2, 4), steps: int = 6, layers: int = 30,
        device: str = "cuda", recent: int = 8, log=print, graph_nodes: bool = False,
        joins=()) -> dict:
    """graph_nodes (CUDA): also the node census of each captured step (`graph_launch.graph_nodes`),
    keyed "<agents>x<columns>". joins: prompt lengths P of join rows (width "join P"): every step
    one agent leaves and a new one joins with a P-token prompt, prefilled in the step that decodes
    the others (continuous batching's join step: the captured prefill step, `DecodeGraphs.run_prefill`)."""
    from polykv.bench import graph_launch
    from polykv.bench.step_profile import top_kernels
    from polykv.pool import SharedKVPool

    cuda = device == "cuda"
    if graph_nodes and cuda:
        graph_launch.debug_graphs()
    census = {}
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = smollm2_shape(device, torch.bfloat16 if cuda else torch.float32, layers,
                          vocab=49152 if cuda else 512)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    pool = SharedKVPool(model, None, k="q8_0", v="turbo3", progress=False, recent=recent)
    doc = pool.add_document(torch.randint(3, V, (ctx,), generator=g).tolist())
    kmax = max(widths)
    # 4 x steps per width (warm-up, timed, host-profiled, device-profiled), each adding 1 row per
    # agent when its drafts are rolled back and at most kmax + 1 otherwise
    cap = 16 + 4 * steps * (len(widths) * (kmax + 1) + len(joins)) + 8 + max(joins, default=0)
    rows = []
    with torch.inference_mode(), pool.open_batch(doc, capacity=agents, seq_capacity=cap, graphs=cuda) as b:
        if kmax:
            b.expect_drafts(kmax)  # every verify width captured up front
        for _ in range(agents):
            b.add(torch.randint(3, V, (16,), generator=g).tolist())
        toks = b.step_tokens()

        ahead = False  # the agents' next tokens already pending (fed on the device by a plain step)

        def step(w):
            """One step; returns the host's (feed, launch, wait + host half) seconds. A plain step
            is the pipelined decode's step_tokens_ahead (each chosen id fed back on the device), a
            verify step launch_verify: both return once the step is queued."""
            nonlocal toks, ahead
            t0 = time.perf_counter()
            if w == 0:
                if not ahead:
                    b.feed(toks)
                t1 = time.perf_counter()
                pending = b.step_tokens_ahead()
                t2 = time.perf_counter()
                toks, ahead = pending.result(), True
            else:
                # drafts a random model all but never accepts: every step a full-width verify
                drafts = {a: [3 + (t % (V - 3))] * w for a, t in toks.items()}
                if ahead:
                    b.feed_drafts(drafts)
                else:
                    b.feed(toks, drafts)
                t1 = time.perf_counter()
                pending = b.launch_verify()
                t2 = time.perf_counter()
                toks, ahead = {a: ids[-1] for a, ids in pending.result().items()}, False
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        def join(p):
            """One join step: the oldest agent leaves, a new one joins with a p-token prompt (feed,
            launch, result as `step`; the step is synchronous: step_tokens)."""
            nonlocal toks, ahead
            t0 = time.perf_counter()
            gone = min(toks)
            b.remove(gone)
            del toks[gone]
            if not ahead:
                b.feed(toks)
            b.add(torch.randint(3, V, (p,), generator=g).tolist())
            t1 = time.perf_counter()
            toks, ahead = b.step_tokens(), False
            return t1 - t0, 0.0, time.perf_counter() - t1

        for w in [*widths, *(f"join {p}" for p in joins)]:
            run_step = (lambda _w=w: join(int(_w.split()[1]))) if isinstance(w, str) else (lambda _w=w: step(_w))
            for _ in range(steps):  # warm-up: captures, first replays
                run_step()
            walls, phases = [], []
            for _ in range(steps):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                phases.append(run_step())
                if cuda:
                    torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            row = dict(width=w, query_rows_per_kv_head=agents * 3 * (w + 1 if isinstance(w, int) else 1),
                       ms_wall_median=round(statistics.median(walls), 3), ms_wall=[round(x, 3) for x in walls],
                       **{f"ms_host_{name}": round(statistics.median(p[i] for p in phases) * 1e3, 3)
                          for i, name in enumerate(("feed", "launch", "result"))})
            with cProfile.Profile() as prof_host:  # the host's Python, the device work waited for
                for _ in range(steps):
                    run_step()
            row["host_top"] = _host_top(prof_host, steps)
            if cuda:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        run_step()
                    torch.cuda.synchronize()
                row["device_ms_per_step"], row["top"] = top_kernels(prof, steps)
                row["device_ops_per_step"] = device_ops(prof, steps)
            rows.append(row)
            if graph_nodes and cuda:
                for kind, caps in (("", b._graphs._graphs), ("prefill ", b._graphs._prefills)):
                    for key, cap in caps.items():  # prefill keys: (B, n_q, agents at every column)
                        name = kind + "x".join(map(str, key))
                        if name not in census and cap.graph is not None:
                            census[name] = c = graph_launch.graph_nodes(cap.graph)
                            c["replay_host_ms"] = graph_launch.replay_host_ms(cap.graph)
                            log(f"graph {name}: nodes {c['nodes']}, edges {c['edge_styles']}, "
                                f"replay host {c['replay_host_ms']:.3f} ms")
            if cuda and b._graphs is not None:
                row["prefill_widths"] = b._graphs.prefill_widths()
            log(f"width {w}: wall {row['ms_wall_median']:.3f} ms/step (host: feed {row['ms_host_feed']:.3f}, "
                f"launch {row['ms_host_launch']:.3f}, result {row['ms_host_result']:.3f})"
                + (f", device {row['device_ms_per_step']:.3f} ms/step" if cuda else ""))
    pool.close()
    base = rows[0]["ms_wall_median"] if rows and rows[0]["width"] == 0 else None
    for r in rows:
        if base:
            r["wall_over_plain"] = round(r["ms_wall_median"] / base, 3)
    return dict(rows=rows, graph_nodes=census, agents=agents, ctx=ctx, layers=model.config.num_hidden_layers, recent=recent,
                device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--widths", default="0,1,2,4")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--recent", type=int, default=8)
    ap.add_argument("--joins", default="", help="prompt lengths of join rows (e.g. 16,32): one agent "
                    "leaves and one joins with such a prompt every step")
    ap.add_argument("--graph-nodes", action="store_true",
                    help="also the node census of each captured step's graph (CUDA's DOT dump)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    res = run(a.agents, a.ctx, tuple(int(x) for x in a.widths.split(",")), a.steps, a.layers, device=a.device,
              recent=a.recent, graph_nodes=a.graph_nodes, joins=tuple(int(x) for x in a.joins.split(",") if x))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "verify_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    base = {r["width"]: r for r in res["rows"]}.get(0)
    for r in res["rows"]:
        print(f"== width {r['width']} ({r['query_rows_per_kv_head']} rows per KV head): "
              f"wall {r['ms_wall_median']:.3f} ms" + (f", device {r['device_ms_per_step']:.3f} ms/step, "
                                                      f"ops {r['device_ops_per_step']}"
                                                      if "device_ms_per_step" in r else ""))
        print(f"   host: feed {r['ms_host_feed']:.3f}, launch {r['ms_host_launch']:.3f}, "
              f"result (wait + host half) {r['ms_host_result']:.3f} ms; own time per step under cProfile:")
        for t in r["host_top"][:8]:
            print(f"  {t['ms_own_per_step']:8.3f} ms own ({t['ms_cum_per_step']:.3f} cum) x{t['calls_per_step']:6.1f}  {t['name']}")
        for t in r.get("top", [])[:12]:
            b = next((x for x in (base or {}).get("top", []) if x["name"] == t["name"]), None)
            print(f"  {t['ms_per_step']:8.3f} ms (plain {b['ms_per_step'] if b else float('nan'):7.3f})"
                  f"  x{t['calls_per_step']:5.1f}  {t['name']}")


if __name__ == "__main__":
    main()
