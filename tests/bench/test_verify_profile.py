"""`polykv.bench.verify_profile` on the CPU (tiny SmolLM2-shape model, eager): every width's steps
run, plain and verify, and their rows are reported."""

from polykv.bench.verify_profile import run
from polykv.pool import agents as agents_mod


def test_verify_profile_rows_cpu(monkeypatch):
    keeps = []
    forward = agents_mod.AgentBatch._forward

    def recorded(self, group, keep=0, *a, **kw):
        keeps.append(keep)
        return forward(self, group, keep, *a, **kw)

    monkeypatch.setattr(agents_mod.AgentBatch, "_forward", recorded)
    r = run(agents=2, ctx=48, widths=(0, 2), steps=2, layers=2, device="cpu", log=lambda *_: None)
    assert [x["width"] for x in r["rows"]] == [0, 2]
    assert [x["query_rows_per_kv_head"] for x in r["rows"]] == [6, 18]
    assert all(x["ms_wall_median"] > 0 and len(x["ms_wall"]) == 2 for x in r["rows"])
    assert r["rows"][0]["wall_over_plain"] == 1.0 and r["layers"] == 2
    # the width-2 steps (2 warm-up, 2 timed, 2 host-profiled) were verify forwards of 3 columns
    assert keeps.count(3) == 6
    for x in r["rows"]:  # the host's phases and its functions by own time
        assert x["ms_host_feed"] >= 0 and x["ms_host_launch"] > 0 and x["ms_host_result"] > 0
        assert x["host_top"] and all(t["ms_own_per_step"] >= 0 and t["calls_per_step"] > 0 for t in x["host_top"])



def test_verify_profile_join_rows_cpu(monkeypatch):
    """--joins P: every step one agent leaves and one joins with a P-token prompt, prefilled in the
    step that decodes the others (on the CPU a forward of its own at P columns)."""
    widths = []
    forward = agents_mod.AgentBatch._forward

    def recorded(self, group, keep=0, *a, **kw):
        widths.append(max(len(x.pending) for x in group))
        return forward(self, group, keep, *a, **kw)

    monkeypatch.setattr(agents_mod.AgentBatch, "_forward", recorded)
    r = run(agents=3, ctx=48, widths=(0,), steps=2, layers=2, device="cpu", log=lambda *_: None, joins=(5,))
    assert [x["width"] for x in r["rows"]] == [0, "join 5"]
    join = r["rows"][1]
    assert join["ms_wall_median"] > 0 and join["wall_over_plain"] > 0 and join["ms_host_feed"] > 0
    # 6 join steps (2 warm-up, 2 timed, 2 host-profiled), each a forward where a 5-token prompt feeds
    assert widths.count(5) == 6
