"""Probe (GPU): where a sliding layer's cascade with a recent window spends its time (issue G,
kernels_notes v20). Gemma-3 local layer (4 q / 1 KV head, head_dim 256, window 512), a 32k q8_0 /
turbo3 prefix, 128-row suffixes, R = 8, at 8 and 32 agents: the graph-replay median of the fused call
(the window as the cascade's third pass), of the apart route (prefix-only windowed cascade, older-rows
decode, segment decode, two LSE merges) and of each piece alone; both checked against the torch
reference; then one graph replay's kernel timeline (torch.profiler) of fused, apart and the plain
windowed cascade at 32 agents. Then fused and apart again with programmatic dependent launch off
(POLYKV_PDL=0; kernels_notes v20's first suspect: every decode program triggers its dependents first
thing, so a decode launched behind a decode parks on the SMs the first one runs on).

    PYTHONPATH=. POLYKV_CACHE_DIR=.pkvcache python3 polykv/bench/window_passes.py

Run it once per tree in one call (PYTHONPATH=<other tree>) to compare (BENCHMARKS §5.17, §5.18).
Writes $OUT/window_passes.json: {piece_agents: graph median us, piece_agents_nopdl: the same without
PDL, rel_*: max relative error against the reference, timeline_*: one replay's kernels}.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from polykv.bench.attention import _median_ms, graphed
from polykv.codecs import get_codec
from polykv.kernels.dispatch import attention_decode, cascade_attention, merge_attention
from polykv.kernels.reference import RecentSegment, cascade_attention_ref

DEV = "cuda"
PREFIX, WINDOW, RECENT, SUFFIX = 32768, 512, 8, 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def timeline(replay) -> list[str]:
    """One graph replay's kernels: start (us from the first) + duration, name."""
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start if ev else 0.0
    return [f"{e.time_range.start - t0:7.1f} + {e.time_range.end - e.time_range.start:6.1f}  {e.name[:70]}"
            for e in ev]


@contextlib.contextmanager
def pdl_off():
    """Launches without programmatic dependent launch (POLYKV_PDL=0), the kernels' plans made anew
    (a plan keeps the launch it was made with) and made anew again afterwards."""
    from polykv.kernels import triton_decode as td

    def forget():
        td._PDL.clear()
        td._PLANS.clear()
        td._CALLS.clear()

    old = os.environ.get("POLYKV_PDL")
    os.environ["POLYKV_PDL"] = "0"
    forget()
    try:
        yield
    finally:
        if old is None:
            del os.environ["POLYKV_PDL"]
        else:
            os.environ["POLYKV_PDL"] = old
        forget()


def main() -> dict:
    g = torch.Generator(device=DEV).manual_seed(11)

    def rnd(*s):
        return torch.randn(*s, device=DEV, generator=g, dtype=torch.float16)

    kc, vc, rc = get_codec("q8_0", 256), get_codec("turbo3", 256), get_codec("q8_0", 256)
    pk, pv = kc.encode(rnd(1, 1, PREFIX, 256)), vc.encode(rnd(1, 1, PREFIX, 256))
    none = (slice(None), slice(None), slice(0, 0))
    res: dict = {}
    for agents in (8, 32):
        sk, sv = kc.encode(rnd(agents, 1, SUFFIX, 256)), vc.encode(rnd(agents, 1, SUFFIX, 256))
        lens = torch.full((agents,), SUFFIX, dtype=torch.int32, device=DEV)
        q = rnd(agents, 4, 1, 256)
        seg = RecentSegment(rc.encode(rnd(agents, 1, RECENT, 256)), rc.encode(rnd(agents, 1, RECENT, 256)),
                            rc, RECENT, torch.zeros(agents, dtype=torch.int32, device=DEV))
        older = lens - RECENT

        def apart():
            o, l = cascade_attention(q, pk, pv, sk.index(none), sv.index(none), lens, kc, vc, window=WINDOW)
            o_s, l_s = attention_decode(q, sk, sv, kc, vc, kv_lens=older, window=WINDOW - RECENT)
            o_r, l_r = attention_decode(q, seg.k, seg.v, rc, rc, window=RECENT, kv_start=seg.kv_start)
            return merge_attention(*merge_attention(o, l, o_s, l_s), o_r, l_r)

        pieces = {
            "fused": lambda: cascade_attention(q, pk, pv, sk, sv, older, kc, vc, window=WINDOW, recent=seg),
            "apart": apart,
            "plain_windowed": lambda: cascade_attention(q, pk, pv, sk, sv, lens, kc, vc, window=WINDOW),
            "prefix_only": lambda: cascade_attention(q, pk, pv, sk.index(none), sv.index(none), lens,
                                                     kc, vc, window=WINDOW),
            "suffix_decode": lambda: attention_decode(q, sk, sv, kc, vc, kv_lens=older,
                                                      window=WINDOW - RECENT),
            "segment_decode": lambda: attention_decode(q, seg.k, seg.v, rc, rc, window=RECENT,
                                                       kv_start=seg.kv_start),
        }
        ref, _ = cascade_attention_ref(q, pk, pv, sk, sv, older, kc, vc, window=WINDOW, recent=seg)
        for name in ("fused", "apart"):
            res[f"rel_{name}_{agents}"] = rel(pieces[name]()[0], ref)
        print(f"{agents} agents: vs the reference, fused rel {res[f'rel_fused_{agents}']:.2e}, "
              f"apart {res[f'rel_apart_{agents}']:.2e}", flush=True)
        replays = {}
        for name, fn in pieces.items():
            replays[name] = graphed(fn)
            res[f"{name}_{agents}"] = _median_ms(replays[name], 10, 100) * 1e3
            print(f"{agents:>3} agents {name:>15}: {res[f'{name}_{agents}']:.1f} us", flush=True)
        if agents == 32:
            for name in ("fused", "apart", "plain_windowed"):
                res[f"timeline_{name}_32"] = lines = timeline(replays[name])
                print(f"--- {name}, one graph replay (32 agents)\n  " + "\n  ".join(lines), flush=True)
        with pdl_off():
            for name in ("fused", "apart"):
                res[f"{name}_{agents}_nopdl"] = _median_ms(graphed(pieces[name]), 10, 100) * 1e3
                print(f"{agents:>3} agents {name:>15}: {res[f'{name}_{agents}_nopdl']:.1f} us without PDL",
                      flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "window_passes.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
