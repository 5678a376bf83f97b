"""`polykv.bench.spec._warm_up`: a side warms up again while its run captured CUDA graphs, so the
timed runs meet no capture a warm-up could have paid (BENCHMARKS §8.18)."""

from polykv.bench import spec


def _runs(captures):
    seen = iter(captures)
    calls = []

    def run():
        calls.append(1)
        return {"graph_captures": next(seen)}

    return run, calls


def test_warm_up_repeats_until_a_run_captures_nothing():
    run, calls = _runs([3, 1, 0, 5])
    assert spec._warm_up(run) == 4 and len(calls) == 3


def test_warm_up_stops_at_warmups_runs():
    run, calls = _runs([2] * 10)
    assert spec._warm_up(run) == 2 * spec.WARMUPS and len(calls) == spec.WARMUPS


def test_a_run_without_captures_warms_up_once():  # the CPU: no graphs, one warm-up as before
    run, calls = _runs([0, 0])
    assert spec._warm_up(run) == 0 and len(calls) == 1
