"""`polykv bench spec` and `polykv demo --speculative` through the real CLI at tiny size (a 2-layer
random Llama with SmolLM2's tokenizer as a local HF directory)."""

from __future__ import annotations

import json

from tests.test_cli_smoke import finite, run_cli, run_json, tiny_dir  # noqa: F401 (fixture)


def test_bench_spec_cpu_smoke_json(tiny_dir, tmp_path):  # noqa: F811
    out = tmp_path / "spec.json"
    obj = run_json(["bench", "spec", "--device", "cpu", "--model", tiny_dir, "--agents", "2", "--max-new-tokens", "6",
                    "--methods", "prompt_lookup,suffix_tree", "--row-invariant", "--out", str(out)])
    rows = obj["rows"]
    assert {(r["workload"], r["method"]) for r in rows} == {(w, m) for w in ("quoting", "freeform")
                                                            for m in ("prompt_lookup", "suffix_tree")}
    for r in rows:
        for key in ("tokens_per_step", "acceptance", "tok_s", "tok_s_baseline", "speedup"):
            assert finite(r[key]), (key, r)
        assert r["identical"] is True and r["agents"] == 2 and r["tok_s"] > 0
        # diagnostics: plain steps only on the baseline side, CPU steps are never captured
        assert set(r["step_ms_baseline"]) == {"0"} and r["step_ms_baseline"]["0"] > 0
        assert r["graph_captures"] == r["graph_captures_baseline"] == 0
    assert json.loads(out.read_text())["rows"] == rows
    assert obj["row_invariant"] is True and obj["device"] == "cpu" and obj["dtype"] == "float32"


def test_bench_spec_dtype_defaults_to_half_precision_on_cuda_only():
    import pytest
    import torch

    from polykv.hf.loading import model_dtype

    assert model_dtype("auto", "cuda") is torch.bfloat16 and model_dtype("auto", "cuda:1") is torch.bfloat16
    assert model_dtype("auto", "cpu") is torch.float32
    assert model_dtype("float16", "cpu") is torch.float16 and model_dtype("float32", "cuda") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        model_dtype("int3", "cuda")


def test_bench_spec_refuses_an_unknown_method(tiny_dir):  # noqa: F811
    res = run_cli(["bench", "spec", "--device", "cpu", "--model", tiny_dir, "--agents", "1", "--max-new-tokens", "2",
                   "--methods", "telepathy", "--json"], ok=False)
    assert res.exit_code != 0


def test_demo_speculative_json(tiny_dir):  # noqa: F811
    obj = run_json(["demo", "--agents", "2", "--max-new-tokens", "4", "--model", tiny_dir,
                    "--speculative", "prompt_lookup:3"])
    assert obj["agents"] == 2 and len(obj["answers"]) == 2
    assert {"steps", "drafted", "accepted", "tokens"} <= set(obj["speculative"])


def test_bench_spec_main_without_typer_times_the_sync_loop(tiny_dir, tmp_path, capsys, monkeypatch):  # noqa: F811
    """`python -m polykv.bench.spec` (the GPU machine has no typer): the CLI's options plus --sync,
    which times the synchronous speculative loop in the same repeats (row fields *_sync), and
    --split-wide, the join split's rule for an A/B (recorded)."""
    from polykv.bench.spec import main
    from polykv.pool import decode_graph

    monkeypatch.setattr(decode_graph, "SPLIT_WIDE", decode_graph.SPLIT_WIDE)  # restored after
    out = tmp_path / "d" / "spec.json"
    main(["--device", "cpu", "--model", tiny_dir, "--agents", "2", "--max-new-tokens", "6", "--workloads", "quoting",
          "--methods", "suffix_tree", "--row-invariant", "--sync", "--dtype", "float32", "--split-wide", "3",
          "--out", str(out)])
    obj = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == obj
    assert obj["split_wide"] == 3 == decode_graph.SPLIT_WIDE
    (r,) = obj["rows"]
    assert obj["sync"] is True and obj["dtype"] == "float32"
    assert r["identical"] is True and r["identical_sync"] is True
    for key in ("tok_s_sync", "speedup_sync", "ms_per_step", "ms_per_step_sync", "ms_per_step_baseline"):
        assert finite(r[key]) and r[key] > 0, key
    assert r["steps_sync"] > 0 and r["graph_captures_sync"] == 0 and 0 <= r["full_accepts"] <= r["agent_steps"]
    assert 0 <= r["pipelined_steps"] <= r["steps"]


def test_bench_spec_requests_per_agent_runs_more_prompts_than_agents(tiny_dir, monkeypatch):  # noqa: F811
    """--requests-per-agent M: M x agents prompts through generate(max_batch=agents) on both sides;
    --recent R: the pool's recent window (joining prompts wrap its ring)."""
    from polykv.pool import SharedKVPool

    seen = []
    generate = SharedKVPool.generate

    def spy(self, doc, prompts, **kw):
        seen.append((len(prompts), kw.get("max_batch"), self.recent))
        return generate(self, doc, prompts, **kw)

    monkeypatch.setattr(SharedKVPool, "generate", spy)
    obj = run_json(["bench", "spec", "--device", "cpu", "--model", tiny_dir, "--agents", "2", "--max-new-tokens", "4",
                    "--workloads", "quoting", "--requests-per-agent", "3", "--row-invariant", "--recent", "2"])
    (r,) = obj["rows"]
    assert r["agents"] == 2 and r["requests"] == 6 and obj["requests_per_agent"] == 3 and obj["recent"] == 2
    assert r["identical"] is True and r["new_tokens"] > 0 and finite(r["speedup"])
    assert seen and set(seen) == {(6, 2, 2)}  # warm-ups and timed runs, both sides
    # the 4 prompts that joined later were prefilled in steps counted apart (both sides)
    assert r["join_steps"] > 0 and r["join_steps_baseline"] > 0 and r["join_ms_baseline"] > 0
    assert r["first_ms"] > 0 and r["first_ms_baseline"] > 0
