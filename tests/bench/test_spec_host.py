"""`polykv.bench.spec_host` runs (its stand-in model must keep up with what the pool reads of a
model): plain and both drafters, answers equal (the bench checks), rows with sensible figures."""

from polykv.bench.spec_host import measure


def test_spec_host_rows():
    r = measure(agents=(4,), tokens=8, repeats=1)
    sides = {row["side"]: row for row in r["rows"]}
    assert {"plain", "prompt_lookup", "suffix_tree", "prompt_lookup sync", "suffix_tree sync"} <= set(sides)
    assert sides["plain"]["x_plain"] == 1.0 and sides["plain"]["tokens_per_step"] == 1.0
    for row in sides.values():  # (the planner's widths follow measured step times: drafting may not pay)
        assert row["host_ms_per_step"] > 0 and row["new_tokens"] == 4 * 8 and row["graph_captures"] == 0
        assert row["steps"] <= sides["plain"]["steps"]  # a verify step emits at least plain's token
