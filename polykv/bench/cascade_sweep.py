"""Sweep launch configurations of the cascade (shared compressed prefix + per-agent suffixes) at one
context length (GPU): CUDA-graph replay time per config and agent count, best first, each config's
output checked against the torch reference on the same packed data (rel. error in the JSON), and
the fp16 dense cascade (bench.attention.dense_cascade) timed once per agent count in the same run.

    PYTHONPATH=. python3 polykv/bench/cascade_sweep.py [--ctx 32768] [--agents 8,32,64] [--configs JSON]
    PYTHONPATH=. ncu ... python3 polykv/bench/cascade_sweep.py --ctx 65536 --agents 32 --configs '[{}]' --profile

Writes cascade_sweep.json under $OUT (or .).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch

from polykv.bench.attention import bench_one

CONFIGS = [  # risky builds last: one that dies in LLVM slows every later config of the process
    {},  # the defaults (Hopper: the warp-specialised prefix pass, gluon_prefix)
    dict(prefix_tune=dict(impl="tile")),  # v10's tile kernel
    dict(prefix_tune=dict(ws=dict(pipe=False))),  # no intra-warp-group overlap
    dict(prefix_tune=dict(ws=dict(prefetch=False))),  # no register prefetch in the producer
]


def _inputs(ctx: int, agents: int, k: str, v: str, suffix: int = 64) -> tuple:
    """A cascade call's arguments (seeded): q [agents, 32, 1, 128] fp16, the packed 8-head prefix of
    ctx rows, suffixes of `suffix` rows, their lengths, the codecs."""
    from polykv.codecs import get_codec

    g = torch.Generator(device="cuda").manual_seed(7)
    kc, vc = get_codec(k, 128), get_codec(v, 128)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float16)

    pk, pv = kc.encode(rnd(1, 8, ctx, 128)), vc.encode(rnd(1, 8, ctx, 128))
    sk, sv = kc.encode(rnd(agents, 8, suffix, 128)), vc.encode(rnd(agents, 8, suffix, 128))
    sl = torch.full((agents,), suffix, dtype=torch.int32, device="cuda")
    return rnd(agents, 32, 1, 128), pk, pv, sk, sv, sl, kc, vc


def check_error(ctx: int, agents: int, k: str, v: str, tune: dict, suffix: int = 64) -> float:
    """rel. error of the cascade under `tune` vs cascade_attention_ref, same packed data."""
    from polykv.kernels import cascade_attention, cascade_attention_ref

    args = _inputs(ctx, agents, k, v, suffix)
    out, _ = cascade_attention(*args, **tune)
    ref, _ = cascade_attention_ref(*args)
    a, b = out.double(), ref.double()
    return float((a - b).norm() / b.norm())


def profile_calls(ctx: int, agents: int, k: str, v: str, tune: dict, calls: int = 3) -> None:
    """`calls` eager cascade calls under `tune`, nothing else timed or checked: the target of a
    profiler (kernels_notes v16: `ncu -k 'regex:_ws_prefix_kernel|_phase_decode_kernel|_combine_kernel'
    --launch-skip 3 -c 3 ... cascade_sweep.py --profile ...`: the second call's three kernels)."""
    from polykv.kernels import cascade_attention

    args = _inputs(ctx, agents, k, v)
    for _ in range(calls):
        cascade_attention(*args, **tune)
    torch.cuda.synchronize()


@contextlib.contextmanager
def module_consts(consts: dict | None):
    """triton_decode's module constants set to `consts` (a config's "consts": e.g.
    {"COMBINE_BLOCK_MIN_ROWS": 1 << 30}, the one-row combine) for the block, every launch and call
    plan dropped before and after (they were made under the other values)."""
    from polykv.kernels import triton_decode as td

    old = {k: getattr(td, k) for k in consts or {}}
    for k, v in (consts or {}).items():
        setattr(td, k, v)
    td._PLANS.clear(), td._CALLS.clear()
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(td, k, v)
        td._PLANS.clear(), td._CALLS.clear()


def _resolve(cfg: dict) -> dict:
    """target_programs_mult (in cfg or its prefix_tune) -> target_programs for this GPU; the
    config's "consts" left out (`module_consts` applies them)."""
    from polykv.kernels.triton_decode import num_programs_target

    tune = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg.items() if k != "consts"}
    for d in (tune, tune.get("prefix_tune") or {}):
        mult = d.pop("target_programs_mult", None)
        if mult:
            d["target_programs"] = int(num_programs_target(torch.device("cuda")) * mult)
    return tune


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--agents", default="8,32,64")
    ap.add_argument("--k", default="q8_0")
    ap.add_argument("--v", default="turbo3")
    ap.add_argument("--configs", default=None,
                    help="a JSON list of tune dicts to sweep instead of CONFIGS ({} = the defaults; "
                         "a dict's \"consts\": triton_decode module constants for that config)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true",
                    help="only three eager calls per agent count and config, for a profiler (ncu)")
    args = ap.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    if args.profile:
        for n in [int(a) for a in args.agents.split(",")]:
            for cfg in configs:
                with module_consts(cfg.get("consts")):
                    profile_calls(args.ctx, n, args.k, args.v, _resolve(cfg))
        return
    rows = []
    for n in [int(a) for a in args.agents.split(",")]:
        for i, cfg in enumerate(configs):
            tune = _resolve(cfg)
            try:
                with module_consts(cfg.get("consts")):
                    r = bench_one(args.ctx, n, args.k, args.v, suffix=64, sdpa=i == 0, tune=tune)
                    err = check_error(args.ctx, n, args.k, args.v, tune)
            except Exception as e:  # noqa: BLE001 - a config that does not build is a result too
                rows.append(dict(agents=n, cfg=cfg, error=repr(e)[:300]))
                print(f"agents {n:3d} {str(cfg):60s} FAILED {e!r}"[:300], flush=True)
                continue
            row = dict(agents=n, cfg=cfg, us=r["ms"] * 1e3, rel_err=err)
            if r.get("ms_dense_cascade"):
                row["us_dense_cascade"] = r["ms_dense_cascade"] * 1e3
                print(f"agents {n:3d} fp16 dense cascade {row['us_dense_cascade']:8.1f} us")
            rows.append(row)
            print(f"agents {n:3d} {str(cfg):60s} {r['ms'] * 1e3:8.1f} us  rel.err {err:.2e}",
                  flush=True)
    with open(os.path.join(args.out, "cascade_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for n in sorted({r["agents"] for r in rows}):
        ok = sorted((r for r in rows if r["agents"] == n and "us" in r), key=lambda r: r["us"])
        default = next((r["us"] for r in rows if r["agents"] == n and r["cfg"] == {} and "us" in r), None)
        if ok:
            print(f"best @{n} agents: {ok[0]['cfg']} {ok[0]['us']:.1f} us" +
                  (f" (default {default:.1f})" if default is not None else ""))


if __name__ == "__main__":
    main()
