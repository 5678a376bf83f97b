"""`polykv bench spec`: speculative decoding vs plain decoding, same model, same prompts, same run.

Workloads over the bundled document (polykv/data/demo_document.md, ~1.8k tokens with SmolLM2; its
paragraphs joined into single lines unless `unwrap=False`: the file is hard-wrapped for reading, and
a model quoting a sentence writes " the" where the file has "\nthe"):
* quoting    questions whose answers quote the document ("quote the sentence that ...", "list the ...
             as written"): what prompt lookup is for.
* freeform   questions answered in the model's own words (a poem, advice, an opinion): little to
             copy; adaptive draft length must back off to plain decoding.

Per (workload, agents, method): untimed warm-ups of each side with the same prompts, then the
plain run and the speculative run alternately (`repeats` times each), greedy, the same prompts and
max_new_tokens. tok_s = new tokens / wall seconds of `pool.generate` (median over repeats), for both
sides; `identical` = every answer's token ids equal between the two sides (greedy is lossless).
One pool for the whole bench, as a server holds one: its batches reuse the storage and the CUDA
graphs captured by earlier calls over the document (`SharedKVPool.max_parked_batches`), and the
speculative side's width planner starts from the step times measured so far (`StepTimes`). The
warm-up pays the captures of the batch size (graph_captures_warmup, _warmup_baseline): the
speculative warm-up's first decode step captures every verify width 1..num_draft_tokens+1 of its
bucket (`AgentBatch.expect_drafts`); a side's warm-up runs again while it captured anything (up to
WARMUPS runs: continuous batching meets prefill and mixed steps of keys a first run may miss), so
graph_captures of the timed runs should be 0 (a width first chosen mid-run captured there before:
1.4 s in one H200 row; a split join step's key in session 27's timed rows, BENCHMARKS §8.18).

Rows (DESIGN §6): {workload, method, agents, tokens_per_step, acceptance, tok_s, tok_s_baseline,
speedup, identical, steps, steps_baseline, drafted, accepted, new_tokens, seconds, seconds_baseline}.
tokens_per_step: tokens emitted per agent per verify forward; steps: batch forwards of the loop.
Diagnostics beside them: step_ms / step_ms_baseline (median ms of a step by its widest draft count,
0 = plain; from `pool.last_generate["step_ms"]`) and graph_captures / graph_captures_baseline (CUDA
graphs the timed runs captured: each costs warm-up forwards and a capture, per bucket and width),
widths: {width: steps} the speculative side's planner chose (0 = plain; `Speculator.propose_all`);
join_split / join_unsplit (_baseline): the last repeat's captured steps where prompts joined, by
whether their attention split (`DecodeGraphs._split`; on the CPU static steps count too).
The document's outputs tree (`suffix_tree`) is emptied before every run.
recent = R: the pool's recent window (0 by default: explicit k / v take none, as every run before
session 25; the default preset's R is 8 — `polykv.pool.ring`, where a joining prompt's rows wrap the
window's ring). requests_per_agent = M > 1: each row runs M x agents prompts through `generate(max_batch=agents)`
on both sides (continuous batching: a finished agent's slot takes the next prompt), so tok/s is a
server's throughput at that many concurrent agents rather than the time of one batch that waits for
its slowest agent; rows then carry requests (the prompts run) beside agents.
`identical` in default numerics compares two different forward shapes (docs/speculative.md: plain
decoding itself changes answers with the batch size); `row_invariant=True` runs both sides with
row-invariant linears (`polykv.spec.invariant`), where identity is the test.
`sync=True` also times the speculative side with `SharedKVPool.spec_overlap` off (the synchronous
loop: no host work while a verify step runs, the outputs tree read up to date) in the same repeats:
tok_s_sync, speedup_sync, steps_sync, tokens_per_step_sync, identical_sync, step_ms_sync.
ms_per_step(_baseline, _sync): wall ms per batch step (seconds / steps); full_accepts / agent_steps:
agent verify steps whose every draft was accepted, of all (`Speculator.stats`); pipelined_steps: plain
steps the speculative side ran pipelined (`Speculator.plain_next`).

Without typer (the GPU machine): `python -m polykv.bench.spec --device cuda --model M.gguf --agents
8,32 --methods prompt_lookup,suffix_tree --sync --out FILE.json` (`main`: the CLI's options).
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

WORKLOADS = {
    "quoting": [
        "Quote, word for word, the sentence of the document that says how long the ferry crossing takes.",
        "Copy exactly as written the sentences of the document about Kelder Point Lighthouse.",
        "Quote the sentence that describes the Greyhallow Stones, exactly as it is written.",
        "List the five settlements of section 3 with their populations, as written in the document.",
        "Quote verbatim the paragraph about Hesketh from the document.",
        "Copy the sentence about the island's motto exactly as written.",
        "Quote word for word the sentences about the great storm of 1893.",
        "Copy exactly the paragraph of the document that describes the Lantern Walk.",
        "Quote the sentence about the Sedley Distillery, word for word.",
        "List, as written in the document, the services described in section 7.",
        "Quote the document's sentence about Tallow Island Airfield verbatim.",
        "Copy word for word the first paragraph of the Overview.",
        "Quote exactly what the document says about the Tallow Museum.",
        "Copy verbatim the sentences about drinking water and Lough Fennick.",
        "Quote the sentences of the document about the climate, exactly as written.",
        "Copy the paragraph on tourism word for word.",
    ],
    "freeform": [
        "Write a short poem about the sea around the island.",
        "In your own words, why would someone choose to live on a small island?",
        "Suggest three names for a new cafe in Port Sedley and explain each one.",
        "Give me advice for a first visit to a windy place in winter.",
        "Describe an imaginary festival you would like to invent for the island.",
        "What are the pros and cons of wind power for a small community? Answer briefly.",
        "Tell a very short story about a lighthouse keeper and a cat.",
        "Explain to a child what a ferry is.",
        "What would you pack for a week of hiking? Give a list.",
        "Invent a recipe that uses herring and explain the steps.",
        "Why do people enjoy visiting museums? Give your opinion.",
        "Write a friendly letter inviting a friend to go birdwatching.",
        "Describe a rainy day in a fishing village with your own imagery.",
        "What questions would you ask a sheep farmer? List five.",
        "Imagine the island in a hundred years and describe it.",
        "Compose a limerick about a seal.",
    ],
}


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def bench_spec(model, tok, agents=(4,), workloads=("quoting", "freeform"), methods=("prompt_lookup",),
               num_draft_tokens: int = 4, max_new_tokens: int = 64, repeats: int = 1, k: str = "q8_0",
               v: str = "turbo3", adaptive: bool = True, document: str | None = None, unwrap: bool = True,
               row_invariant: bool = False, log=lambda m: None, sync: bool = False,
               requests_per_agent: int = 1, recent: int = 0) -> dict:
    import contextlib
    import re

    from ..demo import DATA
    from ..spec.invariant import row_invariant as _row_invariant

    check_args(workloads, methods, k, v, requests_per_agent, recent)

    text = document if document is not None else (DATA / "demo_document.md").read_text(encoding="utf-8")
    if unwrap:  # the file is hard-wrapped at 100 columns; a wrap ("above\nthe") breaks every quote's match
        text = re.sub(r"(?<=\S)\n(?=\S)", " ", text)
    with (_row_invariant(model) if row_invariant else contextlib.nullcontext()):
        out = _bench(model, tok, text, agents, workloads, methods, num_draft_tokens, max_new_tokens, repeats,
                     k, v, adaptive, log, sync, requests_per_agent, recent)
    return dict(out, unwrap=unwrap, row_invariant=row_invariant, sync=sync, requests_per_agent=requests_per_agent,
                recent=recent)


def check_args(workloads, methods, k: str, v: str, requests_per_agent: int = 1, recent: int = 0) -> None:
    """ValueError naming the first bad argument (before any model or document is loaded)."""
    from ..codecs import check_codec_name
    from ..spec import SpecConfig

    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise ValueError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    for m in methods:
        SpecConfig(method=m)
    check_codec_name(k), check_codec_name(v)
    if requests_per_agent < 1:
        raise ValueError(f"requests_per_agent must be >= 1, got {requests_per_agent}")
    if recent < 0:
        raise ValueError(f"recent must be >= 0, got {recent}")


WARMUPS = 3
"""Untimed runs of a side at most before its timed ones (`_warm_up`)."""


def _warm_up(run) -> int:
    """Runs `run()` (a side's `generate`; returns its `last_generate`) until a run captures no CUDA
    graph, at most WARMUPS times; returns the graphs captured in all."""
    captured = 0
    for _ in range(WARMUPS):
        c = run()["graph_captures"]
        captured += c
        if not c:
            break
    return captured


def _bench(model, tok, text, agents, workloads, methods, num_draft_tokens, max_new_tokens, repeats, k, v,
           adaptive, log, sync=False, requests_per_agent: int = 1, recent: int = 0) -> dict:
    from ..pool import SharedKVPool

    dev = next(model.parameters()).device
    pool = SharedKVPool(model, tok, k=k, v=v, recent=recent)
    t0 = time.perf_counter()
    doc = pool.add_document(text, name="demo")
    prefill_s = time.perf_counter() - t0
    rows, mismatches = [], []

    def timed(prompts, spec, max_batch, overlap=True):
        # the outputs tree starts empty for every run: it would otherwise hold the very answers of
        # the previous runs of the same prompts (here they repeat; a deployment sees new questions)
        pool._docs[doc].outputs = None
        pool.spec_overlap = overlap
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            pool.generate(doc, prompts, max_new_tokens=max_new_tokens, speculative=spec, max_batch=max_batch)
        finally:
            pool.spec_overlap = True
        if dev.type == "cuda":
            torch.cuda.synchronize()
        info = pool.last_generate
        return time.perf_counter() - t, info

    for wl in workloads:
        qs = WORKLOADS[wl]
        for n in agents:
            # n agents decode at once (max_batch); with requests_per_agent > 1 the other prompts wait
            prompts = [qs[i % len(qs)] for i in range(n * requests_per_agent)]
            for method in methods:
                spec = {"method": method, "num_draft_tokens": num_draft_tokens, "adaptive": adaptive}
                # warm-up of both paths at this batch size: Triton compiles and the graph captures
                # of its buckets and widths (kept by the pool for the later calls)
                warm = [_warm_up(lambda: timed(prompts, None, n)[1]), _warm_up(lambda: timed(prompts, spec, n)[1])]
                base_s, spec_s, sync_s, caps = [], [], [], [0, 0, 0]
                for _ in range(repeats):
                    s, base = timed(prompts, None, n)
                    base_s.append(s)
                    caps[0] += base["graph_captures"]
                    s, sp = timed(prompts, spec, n)
                    spec_s.append(s)
                    caps[1] += sp["graph_captures"]
                    if sync:
                        s, sy = timed(prompts, spec, n, overlap=False)
                        sync_s.append(s)
                        caps[2] += sy["graph_captures"]
                new = sum(base["new_tokens"])
                same = base["answer_ids"] == sp["answer_ids"]
                if not same:
                    mismatches += [dict(workload=wl, agents=n, method=method, prompt=p)
                                   for p, a, b in zip(prompts, base["answer_ids"], sp["answer_ids"]) if a != b]
                st = sp["speculative"]
                row = dict(workload=wl, method=method, agents=n, requests=len(prompts),
                           num_draft_tokens=num_draft_tokens,
                           tokens_per_step=round(st["tokens_per_step"], 3), acceptance=round(st["acceptance"], 3),
                           tok_s=new / _median(spec_s), tok_s_baseline=new / _median(base_s),
                           identical=same, steps=sp["steps"], steps_baseline=base["steps"],
                           verify_steps=st["steps"], drafted=st["drafted"], accepted=st["accepted"],
                           new_tokens=new, seconds=_median(spec_s), seconds_baseline=_median(base_s),
                           # where a verify step's time goes (the last timed run of each side): step
                           # ms by draft width (0 = plain decode) and the batch's graph captures
                           step_ms=sp["step_ms"]["by_width"], step_ms_baseline=base["step_ms"]["by_width"],
                           # the first step (every first prompt's prefill) and the steps that prefilled
                           # prompts joining later (continuous batching): count and total ms
                           first_ms=sp["step_ms"]["first"], first_ms_baseline=base["step_ms"]["first"],
                           join_steps=sp["step_ms"]["joins"], join_steps_baseline=base["step_ms"]["joins"],
                           join_ms=sp["step_ms"]["joins_ms"], join_ms_baseline=base["step_ms"]["joins_ms"],
                           # of the captured steps where prompts joined (the last repeat): attention split / not
                           join_split=sp["join_steps_split"], join_unsplit=sp["join_steps_unsplit"],
                           join_split_baseline=base["join_steps_split"],
                           join_unsplit_baseline=base["join_steps_unsplit"],
                           graph_captures=caps[1], graph_captures_baseline=caps[0],
                           graph_captures_warmup=warm[1], graph_captures_warmup_baseline=warm[0],
                           widths=st.get("widths", {}), full_accepts=st.get("full_accepts", 0),
                           agent_steps=st.get("agent_steps", 0), pipelined_steps=st.get("pipelined_steps", 0),
                           ms_per_step=_median(spec_s) / sp["steps"] * 1e3,
                           ms_per_step_baseline=_median(base_s) / base["steps"] * 1e3)
                row["speedup"] = row["tok_s"] / row["tok_s_baseline"] if row["tok_s_baseline"] else 0.0
                if sync:
                    sst = sy["speculative"]
                    row.update(tok_s_sync=new / _median(sync_s), steps_sync=sy["steps"],
                               tokens_per_step_sync=round(sst["tokens_per_step"], 3),
                               acceptance_sync=round(sst["acceptance"], 3),
                               identical_sync=base["answer_ids"] == sy["answer_ids"],
                               seconds_sync=_median(sync_s), step_ms_sync=sy["step_ms"]["by_width"],
                               ms_per_step_sync=_median(sync_s) / sy["steps"] * 1e3, graph_captures_sync=caps[2],
                               widths_sync=sst.get("widths", {}))
                    row["speedup_sync"] = row["tok_s_sync"] / row["tok_s_baseline"] if row["tok_s_baseline"] else 0.0
                rows.append(row)
                log(f"{wl:9s} {method:13s} agents {n:3d} ({len(prompts)} prompts): {row['tok_s']:.1f} vs {row['tok_s_baseline']:.1f} tok/s "
                    f"(x{row['speedup']:.2f}), {row['tokens_per_step']:.2f} tokens/verify step, "
                    f"acceptance {row['acceptance']:.2f}, identical {same}"
                    + (f"; sync {row['tok_s_sync']:.1f} tok/s (x{row['speedup_sync']:.2f})" if sync else ""))
    return dict(rows=rows, mismatches=mismatches, device=str(dev), machine=_machine(dev),
                model=getattr(model.config, "_name_or_path", "") or model.config.model_type,
                dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                doc_tokens=len(pool._docs[doc].ids), max_new_tokens=max_new_tokens, repeats=repeats,
                k=k, v=v, adaptive=adaptive, prefill_s=prefill_s, torch_threads=torch.get_num_threads(),
                date=time.strftime("%Y-%m-%d"))


def _machine(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


TABLE_COLUMNS = ["workload", "method", "agents", "tokens_per_step", "acceptance", "tok_s", "tok_s_baseline",
                 "speedup", "identical"]


def main(argv=None) -> None:
    """`polykv bench spec` without typer (the GPU machine has none): the CLI's options, plus --sync."""
    import argparse
    import json
    import pathlib
    import sys

    from ..hf.loading import DTYPES, load_model, model_device, model_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", default="4")
    ap.add_argument("--workloads", default="quoting,freeform")
    ap.add_argument("--methods", default="prompt_lookup")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--fixed", action="store_true")
    ap.add_argument("--keep-wraps", action="store_true")
    ap.add_argument("--row-invariant", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), " + ", ".join(DTYPES))
    ap.add_argument("--k", default="q8_0")
    ap.add_argument("--v", default="turbo3")
    ap.add_argument("--sync", action="store_true", help="also time the synchronous speculative loop")
    ap.add_argument("--requests-per-agent", type=int, default=1,
                    help="prompts per agent slot (continuous batching at --agents concurrent agents)")
    ap.add_argument("--recent", type=int, default=0,
                    help="the pool's recent window R (0: none, as every earlier run; the default preset's is 8)")
    ap.add_argument("--split-wide", type=int, default=None,
                    help="joining agents a split join step computes at every column "
                         "(pool.decode_graph.SPLIT_WIDE; A/B of the rule, BENCHMARKS §8.18)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from ..pool import decode_graph

    if a.split_wide is not None:
        decode_graph.SPLIT_WIDE = a.split_wide
    if a.device == "cuda" or (a.device is None and torch.cuda.is_available()):
        torch.backends.cuda.enable_cudnn_sdp(False)  # the baseline as the earlier GPU runs had it
    dev = model_device(a.device)
    m, tok = load_model(a.model, device=dev, dtype=model_dtype(a.dtype, dev))
    res = bench_spec(m, tok, agents=tuple(int(x) for x in a.agents.split(",") if x),
                     workloads=tuple(w for w in a.workloads.split(",") if w),
                     methods=tuple(x for x in a.methods.split(",") if x), num_draft_tokens=a.num_draft_tokens,
                     max_new_tokens=a.max_new_tokens, repeats=a.repeats, k=a.k, v=a.v, adaptive=not a.fixed,
                     unwrap=not a.keep_wraps, row_invariant=a.row_invariant, sync=a.sync,
                     requests_per_agent=a.requests_per_agent, recent=a.recent,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
    res["split_wide"] = decode_graph.SPLIT_WIDE
    text = json.dumps(res, indent=1, default=str) + "\n"
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
