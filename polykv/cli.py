"""The `polykv` command (also `python -m polykv`). Every command but `serve` takes --json and then
prints exactly one JSON object on stdout; progress and logs go to stderr."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="polykv: shared, compressed KV caches for many agents over one document.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (memory fan-out, attention, end-to-end, serving).")
app.add_typer(bench_app, name="bench")

try:  # the quality harness lives in polykv.eval; mounted when importable
    from .eval.cli import app as _eval_app

    app.add_typer(_eval_app, name="eval")  # its help documents the --text / --prompts formats
except ImportError:  # pragma: no cover - only while the harness is absent
    pass


def emit(obj: dict) -> None:
    """Print one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _console():
    from rich.console import Console

    # Wide tables stay readable when piped to a file or a log.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _ints(s: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of integers ("1,8,32"; empty items skipped), or a one-line error."""
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {s!r}", param_hint=option) from None


def _table(title: str, rows: list[dict], columns: list[str], fmt: dict | None = None):
    from rich.table import Table

    fmt = fmt or {}
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c != columns[0] else "left")
    for r in rows:
        t.add_row(*[(fmt.get(c, "{}")).format(r.get(c, "")) if r.get(c) is not None else "" for c in columns])
    return t


@app.command()
def codecs(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    model: Optional[str] = typer.Option(None, "--model", help="Also measure on this model's real K/V "
                                        "(registry name, HF dir or .gguf)."),
    head_dim: int = typer.Option(128, "--head-dim", help="head_dim of the Gaussian test vectors."),
    tokens: int = typer.Option(1024, "--tokens", help="Tokens of real text to capture K/V from."),
):
    """Table of KV types: measured bits/value and error on N(0,1) data (and on real K/V with --model)."""
    from .codecs.report import gaussian_table

    result: dict = {"head_dim": head_dim, "types": gaussian_table(head_dim)}
    if model is not None:
        from .bench.codecs import real_kv_table
        from .data import corpus_text
        from .hf.loading import load_model

        m, tok = load_model(model)
        text = corpus_text()
        half = len(text) // 2
        result["model"] = model
        result["real"] = real_kv_table(m, tok, text[half:half + 20000], text[:20000], tokens)
    if json_out:
        emit(result)
        return
    con = _console()
    con.print(_table(f"KV types, N(0,1) data, head_dim {head_dim}", result["types"],
                     ["name", "bits_per_value", "rel_mse_gaussian", "cosine_gaussian"],
                     {"bits_per_value": "{:.3f}", "rel_mse_gaussian": "{:.3g}", "cosine_gaussian": "{:.5f}"}))
    if "real" in result:
        cols = ["name", "rel_mse_k", "rel_mse_k_innerq", "rel_mse_v", "cosine_k", "cosine_k_innerq", "cosine_v"]
        con.print(_table(f"real K/V of {model} ({result['real']['tokens']} tokens; InnerQ on "
                         f"{len(result['real']['innerq_layers'])} layers)", result["real"]["rows"], cols,
                         {c: "{:.4g}" for c in cols[1:]}))


@app.command()
def demo(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    agents: int = typer.Option(8, "--agents", min=1, help="Number of agents (questions) over the document."),
    preset: Optional[str] = typer.Option(None, "--preset", help="KV preset: default (K q8_0 / V turbo3), "
                                         "balanced, max (types, InnerQ and recent window, as the API's "
                                         "preset=); --k / --v override its types. Without it the pool holds "
                                         "exactly --k / --v (default q8_0 / turbo3)."),
    k: Optional[str] = typer.Option(None, "--k", help="Key type (overrides the preset)."),
    v: Optional[str] = typer.Option(None, "--v", help="Value type (overrides the preset)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model (default: embedded SmolLM2-135M)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="Speculative decoding: prompt_lookup"
                                              "[:k] or suffix_tree[:k] (same answers; stats in the JSON)."),
):
    """The main job: one bundled document prefilled once, N agents answer questions over it."""
    from .demo import format_demo, run_demo
    from .hf.loading import load_model

    from .presets import resolve

    from .codecs import check_codec_name

    kv = tuple(check_codec_name(t) for t in resolve(preset, k, v)[:2])  # names checked before the model loads
    if preset is None:
        k, v = kv
    m, tok = load_model(model)
    result = run_demo(m, tok, agents=agents, k=k, v=v, preset=preset, max_new_tokens=max_new_tokens,
                      speculative=speculative)
    if json_out:
        emit(result)
    else:
        print(format_demo(result))


@app.command()
def calibrate(
    model: Optional[str] = typer.Option(None, "--model", help="Model (default: embedded SmolLM2-135M)."),
    out: Optional[str] = typer.Option(None, "--out", help="Output file (default: the cache dir, where "
                                      "KVCache(innerq='auto') finds it)."),
    bits: Optional[float] = typer.Option(None, "--bits", help="Also measure each layer's sensitivity and "
                                         "pick per-layer K/V types for this average bits/value budget; the "
                                         "table is saved beside the InnerQ table, where "
                                         "KVCache(preset='balanced'/'max') finds it."),
    scored_tokens: int = typer.Option(256, "--scored-tokens", help="--bits: tokens scored per (layer, type)"),
    prefix_tokens: int = typer.Option(1024, "--prefix-tokens", help="--bits: tokens whose K/V get compressed"),
    copy_weight: float = typer.Option(0.25, "--copy-weight", help="--bits: weight in [0, 1] of a copying "
                                      "signal (KL on teacher-forced random codes in needle prompts, make_codes "
                                      "seed 1) against the novel-text KL; 0 = novel text only (docs/quality.md: "
                                      "0.25 per head holds max's code needles best)"),
    copy_prompts: int = typer.Option(8, "--copy-prompts", help="--bits: needle prompts of the "
                                     "copying signal (one per code kind in turn)"),
    per_head: bool = typer.Option(True, "--per-head/--per-layer", help="--bits: measure and allocate per "
                                  "(layer, KV head), or per layer (KVCache stores each head at its type; "
                                  "SharedKVPool allocates a per-head table collapsed to layers)"),
    json_out: bool = typer.Option(False, "--json"),
):  # --copy-weight / --copy-prompts / --per-head defaults = hf.precision.COPY_WEIGHT / COPY_PROMPTS / PER_HEAD
    # (literals: no torch import for --help)
    """Calibrate InnerQ key scales from real keys of a model and save the table; with --bits, also the
    per-layer precision policy (polykv.hf.precision)."""
    from pathlib import Path

    import torch

    from .hf.capture import calibrate_innerq
    from .hf.loading import load_model
    from .hf.precision import (calibration_ids, copy_examples, measure_sensitivity, policy_summary,
                               precision_path)

    m, tok = load_model(model)
    # The novel's last 2048 tokens: perplexity windows are cut from its start (4 x 2048 by default),
    # so calibration never sees the evaluated text. (Until 2026-12-01: its first 40k characters,
    # i.e. the first evaluation window.)
    ids = calibration_ids(tok, 2048)
    table = calibrate_innerq(m, tok, [torch.tensor(ids)], max_tokens=2048, path=out)
    result = {"path": getattr(table, "path", out), "model": table.model,
              "layers_scaled": sorted(table.scales), "tokens": len(ids),
              "text": "last 2048 tokens of the bundled novel"}
    if bits is not None:
        if not 0.0 <= copy_weight <= 1.0:
            raise typer.BadParameter(f"must be in [0, 1], got {copy_weight}", param_hint="--copy-weight")
        copy = copy_examples(tok, copy_prompts) if copy_weight > 0 else None
        prec = measure_sensitivity(m, tok, ids[-(prefix_tokens + scored_tokens):], innerq=table,
                                   prefix=prefix_tokens, progress=not json_out, copy_weight=copy_weight,
                                   copy=copy, per_head=per_head)
        try:
            policy = prec.add_policy(bits)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--bits") from None
        target = (Path(out).with_name(Path(out).stem + ".precision.json") if out is not None
                  else precision_path(m))
        prec.save(target)
        result.update({"precision_path": str(target), "precision_tokens": prec.meta["tokens"],
                       "precision_metric": prec.meta["metric"], "copy_weight": copy_weight,
                       "copy_prompts": len(copy) if copy else 0, **policy_summary(policy)})
    if json_out:
        emit(result)
    else:
        print(json.dumps(result, indent=2))


@bench_app.command("fanout")
def bench_fanout_cmd(
    agents: str = typer.Option("1,2,4,8,16,32", "--agents", help="Comma-separated agent counts."),
    doc_tokens: int = typer.Option(2048, "--doc-tokens"),
    suffix_tokens: int = typer.Option(64, "--suffix-tokens"),
    k: str = typer.Option("q8_0", "--k"),
    v: str = typer.Option("turbo3", "--v"),
    model: Optional[str] = typer.Option(None, "--model"),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG plot (bytes vs agents) here."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Peak KV bytes with N agents alive: naive f16 copies vs ref-style vs shared (measured)."""
    from .bench.fanout import bench_fanout
    from .hf.loading import load_model

    counts = _ints(agents, "--agents")
    m, tok = load_model(model)
    result = bench_fanout(m, tok, agents=counts, doc_tokens=doc_tokens, suffix_tokens=suffix_tokens,
                          k=k, v=v, plot=plot)
    if json_out:
        emit(result)
    else:
        _console().print(_table(f"fan-out, {doc_tokens}-token document, K {k} / V {v}", result["rows"],
                                ["agents", "naive_bytes", "ref_style_bytes", "shared_bytes"],
                                {c: "{:,}" for c in ("naive_bytes", "ref_style_bytes", "shared_bytes")}))


@bench_app.command("attention")
def bench_attention_cmd(
    ctx: str = typer.Option("4096,16384,65536,131072", "--ctx"),
    agents: str = typer.Option("1", "--agents"),
    pairs: str = typer.Option("q8_0/turbo3,turbo4/turbo3,turbo3/turbo3", "--pairs", help="K/V pairs."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Decode / cascade attention speed vs SDPA on dense f16 (needs a CUDA GPU)."""
    import torch

    if not torch.cuda.is_available():
        raise typer.BadParameter("`polykv bench attention` needs a CUDA GPU (none found)")
    from .bench.attention import bench_attention

    result = bench_attention(ctxs=list(_ints(ctx, "--ctx")), agents=list(_ints(agents, "--agents")),
                             pairs=[tuple(p.split("/")) for p in pairs.split(",")])
    if json_out:
        emit(result)
    else:
        _console().print(_table("attention", result["rows"],
                                ["ctx", "agents", "k", "v", "ms", "ms_sdpa_f16", "speedup", "gbps"],
                                {"ms": "{:.3f}", "ms_sdpa_f16": "{:.3f}", "speedup": "{:.2f}", "gbps": "{:.0f}"}))


@bench_app.command("e2e")
def bench_e2e_cmd(
    agents: str = typer.Option("1,8,32,64", "--agents", help="pool_decode: agent counts over one document."),
    ctx: int = typer.Option(32768, "--ctx", help="pool_decode / prefill: document tokens."),
    layers: int = typer.Option(4, "--layers", help="pool_decode / prefill: model layers."),
    suffix_tokens: int = typer.Option(64, "--suffix-tokens", help="pool_decode: private tokens per agent."),
    kv_ctx: int = typer.Option(16384, "--kv-ctx", help="kvcache_decode: prefilled tokens."),
    kv_layers: int = typer.Option(8, "--kv-layers", help="kvcache_decode: model layers."),
    kv_batches: str = typer.Option("1,8", "--kv-batches", help="kvcache_decode: batch sizes."),
    kv_recent: str = typer.Option("", "--kv-recent", help="kvcache_decode: recent windows R > 0 also "
                                  "timed (comma list)."),
    pool_recent: str = typer.Option("", "--pool-recent", help="pool_decode: recent windows R > 0 also "
                                    "timed (comma list; the default preset's R is 8)."),
    steps: int = typer.Option(20, "--steps", help="Timed decode steps (median reported)."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed decode steps first."),
    scenarios: str = typer.Option("pool_decode,prefill,kvcache_decode", "--scenarios"),
    k: str = typer.Option("q8_0", "--k"),
    v: str = typer.Option("turbo3", "--v"),
    chunk: int = typer.Option(4096, "--chunk", help="Prefill chunk (tokens), polykv and baselines alike."),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu (smoke runs at small sizes)."),
    compile_: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="StaticCache + torch.compile "
                                            "baseline (default: on CUDA only)."),
    tiny: bool = typer.Option(False, "--tiny", help="A toy model of the same family (CPU tests)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write gpu_e2e.json and gpu_e2e.png here."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Whole-model decode and prefill, polykv vs plain transformers, on a random Llama-3-8B-shaped
    model (GPU): N agents over one document, the KVCache drop-in, prefill."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("`polykv bench e2e` needs a CUDA GPU (none found); --device cpu for a smoke run")
    from .bench.e2e import TABLE_COLUMNS, bench_e2e

    result = bench_e2e(agents=_ints(agents, "--agents"), ctx=ctx, layers=layers, kv_ctx=kv_ctx,
                       kv_layers=kv_layers,
                       kv_batches=_ints(kv_batches, "--kv-batches"), steps=steps, warmup=warmup,
                       scenarios=tuple(s for s in scenarios.split(",") if s), k=k, v=v,
                       suffix_tokens=suffix_tokens, chunk=chunk, device=device, compile=compile_, tiny=tiny,
                       out=out, kv_recents=_ints(kv_recent, "--kv-recent"),
                       pool_recents=_ints(pool_recent, "--pool-recent"))
    if json_out:
        emit(result)
        return
    con = _console()
    con.print(_table("end-to-end decode / prefill (ms, wall clock)", result["rows"], TABLE_COLUMNS,
                     {c: "{:.3g}" for c in TABLE_COLUMNS[4:]}))
    for e in result["errors"]:
        con.print(f"[red]error[/red] {e['scenario']} {e.get('agents', '')}: {e['error'][:300]}")


@bench_app.command("offload")
def bench_offload_cmd(
    agents: str = typer.Option("1,8,32,64", "--agents", help="Agent counts over one document."),
    ctx: str = typer.Option("65536,262144", "--ctx", help="Document tokens (comma list)."),
    layers: int = typer.Option(4, "--layers", help="Model layers."),
    suffix_tokens: int = typer.Option(64, "--suffix-tokens", help="Private tokens per agent."),
    steps: int = typer.Option(10, "--steps", help="Timed decode steps (median reported)."),
    warmup: int = typer.Option(2, "--warmup"),
    k: str = typer.Option("q8_0", "--k"),
    v: str = typer.Option("turbo3", "--v"),
    stream_chunk_rows: int = typer.Option(16384, "--stream-chunk-rows", help="Prefix rows per host chunk."),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu (smoke runs at small sizes)."),
    tiny: bool = typer.Option(False, "--tiny", help="A toy model of the same family (CPU tests)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write gpu_offload.json here."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Decode steps over a host-resident (streamed) document vs the same document GPU-resident vs
    transformers' offloaded DynamicCache, with the pinned H2D bandwidth measured in the same run
    (issue H; needs a CUDA GPU)."""
    from pathlib import Path

    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("`polykv bench offload` needs a CUDA GPU (none found); --device cpu for a smoke run")
    from .bench.offload import TABLE_COLUMNS, bench_offload

    def save(result: dict) -> None:  # after every agent count too: a long run that dies keeps its rows
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "gpu_offload.json").write_text(json.dumps(result, indent=1, default=str))

    result = bench_offload(agents=_ints(agents, "--agents"), ctxs=_ints(ctx, "--ctx"), layers=layers,
                           suffix_tokens=suffix_tokens,
                           steps=steps, warmup=warmup, k=k, v=v, stream_chunk_rows=stream_chunk_rows,
                           device=device, tiny=tiny, log=lambda m: print(m, file=sys.stderr, flush=True),
                           on_rows=lambda rows: save({"rows": rows, "partial": True}))
    save(result)
    if json_out:
        emit(result)
        return
    _console().print(_table("host-resident (streamed) vs GPU-resident vs offloaded dense (ms per step)",
                            result["rows"], TABLE_COLUMNS, {c: "{:.3g}" for c in TABLE_COLUMNS[3:]}))


@bench_app.command("serve")
def bench_serve_cmd(
    clients: int = typer.Option(32, "--clients"),
    requests: int = typer.Option(8, "--requests", help="Good (streaming chat) requests per client."),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    model: Optional[str] = typer.Option(None, "--model"),
    torch_threads: Optional[int] = typer.Option(None, "--torch-threads", help="Engine intra-op threads "
                                                "(1 is fastest on a small shared CPU)."),
    time_limit: float = typer.Option(900.0, "--time-limit", help="Stop the load after this many seconds."),
    malformed: float = typer.Option(0.0, "--malformed", help="Malformed requests (bad JSON, wrong types, unknown "
                                    "document, out-of-range values), as a fraction of the good ones, added on "
                                    "top; each must get a 4xx."),
    over_budget: float = typer.Option(0.0, "--over-budget", help="Document adds over the server's KV budget, as "
                                      "a fraction of the good requests, added on top; each must get 429 + "
                                      "Retry-After (the server then runs with a budget that fits the good load)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the shuffle of the request classes."),
    out: Optional[str] = typer.Option(None, "--out", help="Also write the JSON result to this file."),
    use_ray: bool = typer.Option(False, "--ray", help="`polykv serve --ray` instead: the same load over two "
                                 "documents for each of --configs, one after the other (a local Ray instance)."),
    configs: str = typer.Option("1x1,1x2,2x1", "--configs", help="--ray: replicas x torch threads per replica, "
                                "comma-separated."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Bounded loopback load: N concurrent streaming clients x M requests over one shared document,
    optionally with malformed and over-budget requests mixed in (counted per class). With --ray: the
    Ray Serve application with 1 vs 2 replicas over two documents (throughput ratio)."""
    from .bench.serve import bench_serve

    if use_ray:
        from .bench.serve import bench_serve_ray

        if malformed or over_budget:
            raise typer.BadParameter("--ray runs good requests only (no --malformed / --over-budget)")
        result = bench_serve_ray(configs=configs, n_clients=clients, requests_per_client=requests,
                                 max_tokens=max_tokens, model=model, time_limit_s=time_limit, seed=seed,
                                 log=lambda m: print(m, file=sys.stderr, flush=True))
    else:
        result = bench_serve(n_clients=clients, requests_per_client=requests, max_tokens=max_tokens, model=model,
                             torch_threads=torch_threads, time_limit_s=time_limit, malformed=malformed,
                             over_budget=over_budget, seed=seed)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if json_out:
        emit(result)
    else:
        print(json.dumps(result, indent=2))


@bench_app.command("spec")
def bench_spec_cmd(
    agents: str = typer.Option("4", "--agents", help="Agent counts (comma-separated)."),
    workloads: str = typer.Option("quoting,freeform", "--workloads"),
    methods: str = typer.Option("prompt_lookup", "--methods", help="prompt_lookup, suffix_tree (comma-separated)."),
    num_draft_tokens: int = typer.Option(4, "--num-draft-tokens"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    repeats: int = typer.Option(1, "--repeats", help="Timed runs per side (median)."),
    fixed: bool = typer.Option(False, "--fixed", help="Always draft --num-draft-tokens (no adaptive length)."),
    keep_wraps: bool = typer.Option(False, "--keep-wraps", help="Keep the document's hard line wraps (default: "
                                    "paragraphs joined into lines, as pasted text usually is)."),
    row_invariant: bool = typer.Option(False, "--row-invariant", help="Both sides with row-invariant linears "
                                       "(polykv.spec.invariant: token identity independent of forward shapes)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model (default: embedded SmolLM2-135M; a local HF "
                                        "dir works on a machine without the package)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (default when available) or cpu."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights: auto (bfloat16 on CUDA, float32 on CPU), "
                              "bfloat16, float16 or float32."),
    k: str = typer.Option("q8_0", "--k"),
    v: str = typer.Option("turbo3", "--v"),
    requests_per_agent: int = typer.Option(1, "--requests-per-agent", help="Prompts per agent slot: "
                                           "M x agents prompts, at most --agents decoding at once (continuous "
                                           "batching; tok/s is throughput at that concurrency)."),
    recent: int = typer.Option(0, "--recent", help="The pool's recent window R (0: none, as with explicit "
                               "--k / --v; the default preset's is 8)."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the JSON result to this file."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Speculative decoding (prompt lookup / suffix tree) vs plain decoding, same prompts, same run:
    tokens per verify step, acceptance, tok/s, identical answers (issue I)."""
    from pathlib import Path

    from .bench.spec import TABLE_COLUMNS, bench_spec, check_args
    from .hf.loading import load_model, model_device, model_dtype

    wls, ms = tuple(w for w in workloads.split(",") if w), tuple(x for x in methods.split(",") if x)
    check_args(wls, ms, k, v, requests_per_agent, recent)
    counts = _ints(agents, "--agents")
    dev = model_device(device)
    m, tok = load_model(model, device=dev, dtype=model_dtype(dtype, dev))
    result = bench_spec(m, tok, agents=counts,
                        workloads=wls, methods=ms, num_draft_tokens=num_draft_tokens,
                        max_new_tokens=max_new_tokens, repeats=repeats, k=k, v=v, adaptive=not fixed,
                        unwrap=not keep_wraps, row_invariant=row_invariant,
                        requests_per_agent=requests_per_agent, recent=recent,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    if json_out:
        emit(result)
        return
    _console().print(_table("speculative vs plain decoding", result["rows"], TABLE_COLUMNS,
                            {"tokens_per_step": "{:.2f}", "acceptance": "{:.2f}", "tok_s": "{:.1f}",
                             "tok_s_baseline": "{:.1f}", "speedup": "{:.2f}"}))


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    model: Optional[str] = typer.Option(None, "--model"),
    preset: Optional[str] = typer.Option(None, "--preset", help="KV preset: default (K q8_0 / V turbo3), "
                                         "balanced, max; --k / --v override it."),
    k: Optional[str] = typer.Option(None, "--k", help="Key type (overrides the preset)."),
    v: Optional[str] = typer.Option(None, "--v", help="Value type (overrides the preset)."),
    store: Optional[str] = typer.Option(None, "--store", help="Directory where documents persist."),
    budget_bytes: Optional[int] = typer.Option(None, "--budget-bytes", help="KV memory budget (the old name "
                                               "of --gpu-budget)."),
    gpu_budget: Optional[int] = typer.Option(None, "--gpu-budget", help="Bytes of GPU-tier KV: documents + agent "
                                             "suffixes on the device (documents beyond it move to the host "
                                             "tier, or are evicted)."),
    host_budget: Optional[int] = typer.Option(None, "--host-budget", help="Bytes of host-tier documents (pinned "
                                              "host memory, streamed into attention; default: no host tier)."),
    torch_threads: Optional[int] = typer.Option(None, "--torch-threads", help="Engine intra-op threads."),
    device: str = typer.Option("auto", "--device", help="Where the model and the KV live: auto (cuda when a GPU "
                               "is there, else cpu), cpu, cuda, cuda:N."),
    dtype: str = typer.Option("auto", "--dtype", help="Weights: auto (bfloat16 on CUDA, float32 on CPU), "
                              "bfloat16, float16, float32."),
    speculative: Optional[str] = typer.Option(None, "--speculative", help="Default speculative decoding of "
                                              "document requests: prompt_lookup[:k] or suffix_tree[:k] (a request's "
                                              "own `speculative` wins)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="POLYKV_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    use_ray: bool = typer.Option(False, "--ray", help="Serve on Ray Serve: N engine replicas behind one "
                                 "OpenAI-compatible ingress, document affinity, shared published pools "
                                 "(pip install 'polykv-engine[ray]'; docs/serving.md)."),
    replicas: int = typer.Option(2, "--replicas", min=1, help="--ray: engine replicas."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="--ray: the Ray cluster to join "
                                              "('auto' after `ray start`; default: $RAY_ADDRESS, else a new "
                                              "local one)."),
    cpus_per_replica: float = typer.Option(1.0, "--cpus-per-replica", help="--ray: CPUs Ray reserves per "
                                           "replica (also its torch threads unless --torch-threads)."),
):
    """OpenAI-compatible HTTP server over shared compressed documents."""
    from .server import serve as _serve

    if speculative:
        import os

        from .spec import SpecConfig

        try:
            SpecConfig.parse(speculative)
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(f"--speculative: {e}")
        os.environ["POLYKV_SPECULATIVE"] = speculative  # read per request (server/routes/completions.py)

    from .hf.loading import DTYPES

    if dtype != "auto" and dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype: unknown {dtype!r}: auto, {', '.join(DTYPES)}")
    if budget_bytes is not None and gpu_budget is not None and budget_bytes != gpu_budget:
        raise typer.BadParameter("--budget-bytes is the old name of --gpu-budget: give one (or equal values)")
    if use_ray:
        try:
            from .ray import serve_ray
            import ray  # noqa: F401
        except ImportError as exc:
            raise typer.BadParameter(f"--ray needs Ray Serve ({exc}): pip install 'polykv-engine[ray]'") from exc
        serve_ray(host=host, port=port, replicas=replicas, address=ray_address, cpus_per_replica=cpus_per_replica,
                  torch_threads=torch_threads, model=model, k=k, v=v, preset=preset, store=store,
                  budget_bytes=gpu_budget if gpu_budget is not None else budget_bytes,
                  host_budget_bytes=host_budget, api_key=api_key)
        return
    _serve(host=host, port=port, model=model, k=k, v=v, store=store,
           budget_bytes=gpu_budget if gpu_budget is not None else budget_bytes, host_budget_bytes=host_budget,
           torch_threads=torch_threads, api_key=api_key, preset=preset, device=device, dtype=dtype)


def main() -> None:
    """`app()`, with a user's mistake (an unknown KV type, model or preset, a bad value, a missing
    file: ValueError / OSError and their kinds) told in one line on stderr, exit 2, as click tells
    its own; $POLYKV_TRACEBACK=1 shows the traceback instead."""
    import os

    try:
        app()
    except (ValueError, OSError) as exc:
        if os.environ.get("POLYKV_TRACEBACK"):
            raise
        typer.echo(f"Error: {exc} ({type(exc).__name__})", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
