"""Host time of eager attention calls on the GPU (issue F: ≤ 60 µs per call), and where it goes.

    PYTHONPATH=. python3 polykv/bench/host_time.py            # writes host_time.json under $OUT

Calls whose device time is small are host-bound: the host queues call after call while the GPU
waits. Per case (q8_0 / turbo3 decode and turbo4 / turbo3 decode of one sequence at 4k; the
cascade of 8 and 32 agents over a 4k prefix with 64-token suffixes; 32 q / 8 KV heads, head_dim
128, fp16) it reports, each a median over rounds of `calls` back-to-back calls:

- us_call: wall time per call with one synchronize per round (host-bound: this is host time),
  rounds alternating with the launch cache off (us_call_uncached; uncached_over_planned: the
  median of the per-round ratios);
- us_device: the same call replayed from a CUDA graph (device time, for contrast);
- us_python: per call with every Triton launch replaced by a no-op (polykv's own Python, launch
  cache off); us_python_planned: the same with the planned launches (cache on) stubbed;
- per kernel: us_launch (Triton's `fn[grid](...)` with the call's arguments), us_bind (Triton's
  argument binder alone) and us_run (the compiled kernel's launcher alone).
Each case runs with polykv's launch cache on and off (`polykv.kernels.launch.enabled`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time

import torch


def _per_call_us(fn, calls: int = 200, rounds: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(out)


def _cases(device="cuda"):
    from polykv.codecs import get_codec
    from polykv.kernels import attention_decode, cascade_attention

    g = torch.Generator(device=device).manual_seed(3)
    rnd = lambda *s: torch.randn(*s, device=device, dtype=torch.float16, generator=g)  # noqa: E731
    scale = 1 / math.sqrt(128)
    for kn, vn in (("q8_0", "turbo3"), ("turbo4", "turbo3")):
        kc, vc = get_codec(kn, 128), get_codec(vn, 128)
        kp, vp = kc.encode(rnd(1, 8, 4096, 128)), vc.encode(rnd(1, 8, 4096, 128))
        q = rnd(1, 32, 1, 128)
        yield f"decode 4k {kn}/{vn}", lambda: attention_decode(q, kp, vp, kc, vc, sm_scale=scale)
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    kp, vp = kc.encode(rnd(1, 8, 4096, 128)), vc.encode(rnd(1, 8, 4096, 128))
    for n in (8, 32):
        sk, sv = kc.encode(rnd(n, 8, 64, 128)), vc.encode(rnd(n, 8, 64, 128))
        sl = torch.full((n,), 64, dtype=torch.int32, device=device)
        q = rnd(n, 32, 1, 128)
        yield (f"cascade {n} agents 4k+64",
               lambda q=q, sk=sk, sv=sv, sl=sl: cascade_attention(q, kp, vp, sk, sv, sl, kc, vc,
                                                                  sm_scale=scale))


class _Recorder:
    """Patches Triton's JITFunction.run: records each launch's (fn, grid, args, kwargs), or skips
    the launch (stub=True)."""

    def __init__(self, stub: bool):
        from triton.runtime.jit import JITFunction

        self.cls, self.orig, self.stub, self.calls = JITFunction, JITFunction.run, stub, []

    def __enter__(self):
        rec = self

        def run(fn, *args, grid, warmup, **kwargs):
            if rec.stub:
                return None
            rec.calls.append((fn, grid, args, dict(kwargs)))
            return rec.orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        self.cls.run = run
        return self

    def __exit__(self, *exc):
        self.cls.run = self.orig


def _kernel_costs(fn, grid, args, kwargs) -> dict:
    """Triton's launch of one recorded call split into its binder and its launcher."""
    from triton import knobs
    from triton.runtime.driver import driver

    dev = driver.active.get_current_device()
    binder = fn.device_caches[dev][4]
    kernel = fn[grid](*args, **kwargs)
    bound = list(binder(*args, **kwargs)[0].values())
    stream = driver.active.get_current_stream(dev)
    g = tuple(grid) + (1,) * (3 - len(grid))
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return dict(
        kernel=fn.__name__ if hasattr(fn, "__name__") else str(fn), n_args=len(bound),
        us_launch=_per_call_us(lambda: fn[grid](*args, **kwargs)),
        us_bind=_per_call_us(lambda: binder(*args, **kwargs)),
        us_run=_per_call_us(lambda: kernel.run(*g, stream, kernel.function, kernel.packed_metadata,
                                               None, *hooks, *bound)))


def main() -> None:
    from polykv.bench.attention import graphed
    from polykv.kernels import launch

    torch.backends.cuda.enable_cudnn_sdp(False)
    rows = []
    for name, fn in _cases():
        row = dict(case=name)
        # cache on / off alternating round by round (the host's speed drifts between runs)
        on, off = [], []
        for _ in range(7):
            for flag, acc in ((True, on), (False, off)):
                launch.enabled = flag
                acc.append(_per_call_us(fn, rounds=1))
        launch.enabled = True
        row.update(us_call=statistics.median(on), us_call_uncached=statistics.median(off),
                   uncached_over_planned=statistics.median(b / a for a, b in zip(on, off)))
        row["us_device"] = _per_call_us(graphed(fn))
        run = launch.Planned.__call__
        launch.Planned.__call__ = lambda self, *t: None  # planned launches stubbed: their Python
        try:
            row["us_python_planned"] = _per_call_us(fn)
        finally:
            launch.Planned.__call__ = run
        launch.enabled = False  # every launch through JITFunction.run, stubbed or recorded
        with _Recorder(stub=True):
            row["us_python"] = _per_call_us(fn)
        with _Recorder(stub=False) as rec:
            fn()
        row["kernels"] = [_kernel_costs(*c) for c in rec.calls]
        launch.enabled = True
        rows.append(row)
        ks = ", ".join(f"{k['kernel']}: launch {k['us_launch']:.1f} bind {k['us_bind']:.1f} "
                       f"run {k['us_run']:.1f}" for k in row["kernels"])
        print(f"{name}: {row['us_call']:.1f} us/call (launch cache off {row['us_call_uncached']:.1f}), "
              f"device {row['us_device']:.1f}, polykv python {row['us_python']:.1f} "
              f"(planned {row['us_python_planned']:.1f}); {ks}", flush=True)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    kd = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.float16)
    sdpa = _per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, kd, kd))
    print(f"anchor: torch SDPA fp16 4k eager {sdpa:.1f} us/call")
    with open(os.path.join(os.environ.get("OUT", "."), "host_time.json"), "w") as f:
        json.dump(dict(rows=rows, us_sdpa_4k=sdpa, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
