"""Smoke test of `polykv bench e2e` on CPU: a tiny random Llama, every scenario at toy size, through the
real CLI. Timings on CPU mean nothing; what is checked is that every code path the GPU run takes
(pool batch, KVCache, DynamicCache and StaticCache baselines, JSON, plot) runs and fills the DESIGN §6
contract, so the one GPU call does not die on a typo."""

import inspect
import json

import pytest
import torch

from tests.bench.test_cli_bench import run_json

E2E_ROW = {"scenario", "agents", "layers", "ctx", "ms_polykv", "ms_baseline", "speedup"}

TINY = ["bench", "e2e", "--device", "cpu", "--tiny", "--agents", "1,2", "--ctx", "64", "--layers", "2",
        "--suffix-tokens", "8", "--kv-ctx", "64", "--kv-layers", "2", "--kv-batches", "1,2", "--steps", "2",
        "--warmup", "1", "--chunk", "32", "--pool-recent", "2", "--kv-recent", "2"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    return run_json(TINY + ["--out", str(out), "--json"]), out


def test_contract_rows(tiny_run):
    obj, out = tiny_run
    assert obj["errors"] == [] and obj["skipped"] == []
    rows = obj["rows"]
    assert [(r["scenario"], r["agents"]) for r in rows] == [
        ("pool_decode", 1), ("pool_decode", 2), ("prefill", 1), ("kvcache_decode", 1), ("kvcache_decode", 2)]
    for r in rows:
        assert E2E_ROW <= set(r), r
        assert r["ms_polykv"] > 0 and r["ms_baseline"] > 0, r
        assert r["speedup"] == pytest.approx(r["ms_baseline"] / r["ms_polykv"])
        assert r["layers"] == 2 and r["ctx"] == 64
        assert r["kv_bytes_polykv"] > 0 and r["kv_bytes_baseline"] > 0, r
    # the dense baseline holds one f16 copy per agent; polykv one compressed document
    pool = {r["agents"]: r for r in rows if r["scenario"] == "pool_decode"}
    for r in pool.values():  # the pipelined loop beside the synchronous one, the same tokens
        assert r["ms_polykv_pipelined"] > 0 and r["pipelined_identical"] is True, r
        assert r["speedup_pipelined"] == pytest.approx(r["ms_baseline"] / r["ms_polykv_pipelined"])
        assert "ms_polykv_eager_modules" not in r  # compile is off on the CPU (--compile's default)
        # --pool-recent: the same rows for a pool with a recent window (a preset pool's default)
        assert r["ms_polykv_recent2"] > 0 and r["ms_polykv_pipelined_recent2"] > 0, r
        assert r["speedup_pipelined_recent2"] == pytest.approx(r["ms_baseline"] / r["ms_polykv_pipelined_recent2"])
    assert pool[2]["kv_bytes_baseline"] > pool[1]["kv_bytes_baseline"] + pool[1]["kv_bytes_baseline_single_copy"] // 2
    assert pool[2]["kv_bytes_polykv_shared"] == pool[1]["kv_bytes_polykv_shared"]
    kv = [r for r in rows if r["scenario"] == "kvcache_decode"]
    for r in kv:
        assert r["ms_static_eager"] > 0 and r["polykv_path"] in ("DecodeGraph", "eager")
        assert r["ms_polykv_recent2"] > 0, r  # --kv-recent through the CLI
        assert r["ms_static_compile"] is None and "compile off" in r["static_compile_error"]  # CPU default


def test_env_files_and_cpu_only(tiny_run):
    obj, out = tiny_run
    env = obj["env"]
    assert {"date", "torch", "transformers", "triton", "device"} <= set(env) and env["device"] == "cpu"
    assert "gpu" not in env  # no CUDA call on CPU
    assert obj["config"]["tiny"] and obj["config"]["compile"] is False
    saved = json.loads((out / "gpu_e2e.json").read_text())
    assert saved["rows"] == obj["rows"]
    assert (out / "gpu_e2e.png").stat().st_size > 0


def test_cli_defaults_match_module():
    """The CLI and `python polykv/bench/e2e.py` share one set of defaults (the GPU command relies on
    them fitting the time budget)."""
    from polykv.bench.e2e import DEFAULTS, SCENARIOS
    from polykv.cli import bench_e2e_cmd

    opts = {n: p.default.default for n, p in inspect.signature(bench_e2e_cmd).parameters.items()}
    for name, value in DEFAULTS.items():
        cli = opts[name]
        if isinstance(value, tuple):
            cli = tuple(int(x) for x in cli.split(","))
        assert cli == value, name
    assert tuple(opts["scenarios"].split(",")) == SCENARIOS


def test_scenario_failure_is_recorded_not_fatal(monkeypatch):
    """One broken scenario leaves an error entry; the others still produce rows."""
    from polykv.bench import e2e

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(e2e, "run_prefill", boom)
    r = e2e.bench_e2e(agents=(1,), ctx=32, layers=1, kv_ctx=32, kv_layers=1, kv_batches=(1,), steps=1, warmup=0,
                      scenarios=("prefill", "pool_decode"), suffix_tokens=4, chunk=16, device="cpu", tiny=True,
                      log=lambda *_: None)
    assert [e["scenario"] for e in r["errors"]] == ["prefill"] and "boom" in r["errors"][0]["error"]
    assert [x["scenario"] for x in r["rows"]] == ["pool_decode"] and r["rows"][0]["ms_baseline"] > 0


def test_next_tokens_falls_back_to_step():
    """Batches without `step_tokens` (before it landed) take the greedy argmax of `step`'s logits."""
    from polykv.bench.e2e import _next_tokens

    class Old:
        def step(self):
            return {0: torch.tensor([0.0, 3.0, 1.0]), 5: torch.tensor([2.0, 0.0, 1.0])}

    assert _next_tokens(Old()) == ({0: 1, 5: 0}, "step+argmax")


def test_baseline_need_bytes():
    from polykv.bench.e2e import baseline_need_bytes

    # 64 agents x 0.5 GiB of 4-layer document KV, GQA 4: 32 GiB of copies + 5/4 of a layer's copies + 2 GiB
    assert baseline_need_bytes(64, 1 << 29, 4, 4) == (32 << 30) + 5 * (8 << 30) + (2 << 30)


@pytest.fixture(scope="module")
def tiny_model():
    """The bench's tiny model with sharp attention: at the default init (std 0.02) its greedy token
    is the same at every position whatever the context, so token equality would prove nothing;
    larger q/k/v/o weights make every token depend on keys, values and positions."""
    from polykv.bench.e2e import build_model

    model = build_model(2, torch.device("cpu"), torch.float32, tiny=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "q_" in name or "k_" in name else 0.2))
    return model


def _doc_and_suffixes(n: int, ctx: int = 40, s: int = 5):
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 256, (ctx,), generator=g), torch.randint(3, 256, (n, s), generator=g)


def test_baseline_and_pool_decode_the_same_tokens(tiny_model):
    """With f16 K/V the pool and the batched DynamicCache baseline are the same computation: equal
    greedy tokens at every step prove the baseline's copies, positions and suffix prefill right (a
    baseline computing something else would time something else)."""
    from transformers import DynamicCache

    from polykv.bench.e2e import Clock, _pool_baseline, _pool_polykv, prefill, use_attention
    from polykv.pool import SharedKVPool

    clock = Clock(torch.device("cpu"))
    doc_ids, sfx = _doc_and_suffixes(3)
    pool = SharedKVPool(tiny_model, None, k="f16", v="f16", progress=False, prefill_chunk=16)
    doc = pool.add_document(doc_ids.tolist())
    use_attention(tiny_model, "sdpa")
    doc_cache = DynamicCache(config=tiny_model.config)
    prefill(tiny_model, doc_cache, doc_ids[None], 16)
    base, ours = [], []
    _pool_baseline(clock, tiny_model, doc_cache, len(doc_ids), sfx, 1, 3, trace=base)
    _pool_polykv(clock, pool, doc, sfx.tolist(), 1, 3, trace=ours)
    assert len(base) == len(ours) == 5 and base == ours
    assert len({t for step in base for t in step}) > 5  # tokens that depend on the context


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_pipelined_pool_decode_the_same_tokens(tiny_model, monkeypatch, static):
    """The pipelined loop (`_pool_polykv_pipelined`: step t+1 launched with step t's ids fed on the
    device, step t read after) traces the synchronous loop's tokens at every step, the suffix
    prefill's included — eagerly, and through the static decode step a CUDA graph captures
    (`capture=False`), which the pipelined batch takes over from the synchronous one (no capture)."""
    import functools

    from polykv.bench.e2e import Clock, _pool_polykv
    from polykv.pool import SharedKVPool, decode_graph

    if static:
        monkeypatch.setattr(decode_graph, "graphs_supported", lambda cache: True)
        monkeypatch.setattr(decode_graph, "DecodeGraphs", functools.partial(decode_graph.DecodeGraphs, capture=False))
    clock = Clock(torch.device("cpu"))
    doc_ids, sfx = _doc_and_suffixes(3)
    pool = SharedKVPool(tiny_model, None, progress=False, prefill_chunk=16)
    doc = pool.add_document(doc_ids.tolist())
    sync, piped = [], []
    row = _pool_polykv(clock, pool, doc, sfx.tolist(), 2, 4, trace=sync, trace_pipelined=piped)
    assert len(sync) == 7 and piped == sync
    assert len({t for step in sync for t in step}) > 5
    assert row["ms_polykv_pipelined"] > 0 and row["ms_polykv_pipelined_mean"] > 0
    assert row["polykv_pipelined_captures"] == 0


def test_clock_loop_times_intervals():
    """Clock.loop: the median gap between the ends of consecutive timed calls (warm-up untimed)."""
    import time as _time

    from polykv.bench.e2e import Clock

    calls = []

    def step():
        calls.append(1)
        _time.sleep(0.02 if len(calls) <= 2 else 0.005)

    t = Clock(torch.device("cpu")).loop(step, 2, 5)
    assert len(calls) == 7 and t["steps"] == 5
    assert 4 <= t["ms"] < 15 and t["ms_min"] <= t["ms"] <= t["ms_max"] and t["ms_mean"] < 15


def test_use_attention_switches_back_for_the_pool(tiny_model):
    """The baselines switch the model to plain SDPA; the pool's batches only compute the right thing
    after `use_attention(model, "polykv")` switches it back (the pool runs after a baseline in every
    pool_decode row but the first)."""
    from polykv.bench.e2e import Clock, _pool_polykv, use_attention
    from polykv.pool import SharedKVPool

    clock = Clock(torch.device("cpu"))
    doc_ids, sfx = _doc_and_suffixes(2)
    pool = SharedKVPool(tiny_model, None, progress=False, prefill_chunk=16)
    doc = pool.add_document(doc_ids.tolist())
    first, again = [], []
    _pool_polykv(clock, pool, doc, sfx.tolist(), 0, 3, trace=first)
    use_attention(tiny_model, "sdpa")
    _pool_polykv(clock, pool, doc, sfx.tolist(), 0, 3, trace=again)  # switches back itself
    assert tiny_model.config._attn_implementation == "polykv" and again == first


@pytest.mark.parametrize("batch", [1, 2])
def test_kvcache_paths_decode_the_same_tokens(tiny_model, batch):
    """DynamicCache, StaticCache (eager) and polykv KVCache with f16 K/V (through DecodeGraph's
    CPU step where it exists) decode the same greedy tokens: every timed loop of kvcache_decode
    computes the real decode step at the right positions."""
    from polykv.bench.e2e import Clock, _kv_dynamic, _kv_polykv_any, _kv_static

    clock = Clock(torch.device("cpu"))
    ids = torch.randint(3, 256, (batch, 40), generator=torch.Generator().manual_seed(batch))
    dyn, static, ours = [], [], []
    _kv_dynamic(clock, tiny_model, ids, 16, 1, 3, trace=dyn)
    _kv_static(clock, tiny_model, ids, 16, 1, 3, compile=False, log=print, trace=static)
    row = _kv_polykv_any(clock, tiny_model, ids, "f16", "f16", 16, 1, 3, print, trace=ours)
    assert len(dyn) == 5 and dyn == static == ours, row.get("polykv_graph_error")
    assert len({t for step in dyn for t in step}) > 3


def test_kvcache_rows_time_recent_windows_too(tmp_path):
    """--kv-recent R: each kvcache_decode row also carries the KVCache with a recent window of R
    rows (issue K) beside the same baselines."""
    from polykv.bench.e2e import main

    obj = main(["--device", "cpu", "--tiny", "--scenarios", "kvcache_decode", "--kv-ctx", "64",
                "--kv-layers", "2", "--kv-batches", "1", "--steps", "2", "--warmup", "1", "--chunk", "32",
                "--kv-recent", "8", "--out", str(tmp_path), "--json"])
    (row,) = obj["rows"]
    assert obj["errors"] == [] and obj["config"]["kv_recents"] == [8]
    assert row["ms_polykv_recent8"] > 0 and row["kv_bytes_polykv_recent8"] > row["kv_bytes_polykv"]
    assert row["speedup_recent8"] == pytest.approx(row["ms_baseline"] / row["ms_polykv_recent8"])
