"""Smoke tests of the `polykv bench ...` commands: each runs through the real CLI at tiny size and
its one JSON object carries the DESIGN §6 contract fields."""

import json

import pytest
from typer.testing import CliRunner

FANOUT_ROW = {"agents", "naive_bytes", "ref_style_bytes", "shared_bytes"}


def run_json(args: list[str]) -> dict:
    """Invoke `polykv ARGS` in process; the last stdout line is the command's JSON object."""
    from polykv.cli import app

    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, f"{res.output}\n{res.exception!r}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.model
def test_bench_fanout_json(tmp_path):
    plot = tmp_path / "fanout.png"
    obj = run_json(["bench", "fanout", "--agents", "1,2", "--doc-tokens", "64", "--suffix-tokens", "4",
                    "--plot", str(plot), "--json"])
    rows = obj["rows"]
    assert [r["agents"] for r in rows] == [1, 2]
    for r in rows:
        assert FANOUT_ROW <= set(r), r
        assert all(isinstance(r[f], int) and r[f] > 0 for f in FANOUT_ROW), r
    # a second agent adds a whole f16 copy to the naive figure, only a 4-token suffix to the shared one
    assert rows[1]["naive_bytes"] > rows[0]["naive_bytes"]
    assert rows[1]["shared_bytes"] - rows[0]["shared_bytes"] < rows[1]["naive_bytes"] - rows[0]["naive_bytes"]
    assert plot.stat().st_size > 0
