"""`polykv.bench.cpu_step` on a tiny random model: its rows and fields."""

from polykv.bench.cpu_step import run


def test_cpu_step_rows():
    r = run(tiny=True, agents=(1, 2), new_tokens=3, repeats=2, log=lambda *_: None)
    assert [(x["k"], x["v"], x["agents"]) for x in r["rows"]] == [
        ("q8_0", "turbo3", 1), ("q8_0", "turbo3", 2), ("turbo4", "turbo2", 1), ("turbo4", "turbo2", 2)]
    assert all(x["step_ms"] > 0 and len(x["step_ms_runs"]) == 2 for x in r["rows"])
    assert set(r["rows"][1]["decode_us"]) == {"q8_0", "turbo3"}
    assert set(r["rows"][3]["decode_us"]) == {"turbo4", "turbo2"}
