"""Offline SASS of the phase-decode kernel (no GPU needed): by default what one program executes
for a recent window's 8-row segment (Gemma-3 local layer shape: 4 q / 1 KV head, head_dim 256, K
and V q8_0, 32 agents, R = 8); with --decode K/V, the split pass of one sequence's decode on a
Llama-8B layer (32 q / 8 KV heads, head_dim 128) in that pair, whose loop runs once per key tile.
Built for sm_90 at several key tiles.

    python -m polykv.bench.sass_segment [--block-n 64,16] [--decode turbo4/turbo3] [--out FILE.json]

The launch is recorded from `dispatch.attention_decode` in Triton's interpreter (a subprocess with
TRITON_INTERPRET=1: the arguments, grid and constexprs polykv passes), then compiled here with
`triton.compile(..., target=GPUTarget("cuda", 90, 32))` as the GPU would (inline-asm decode on,
PDL on) and disassembled with the cuobjdump of Triton's wheel. Per tile: SASS instructions, registers,
spills (LDL / STL) and a few opcode counts (NOP padding left out). A segment has fewer rows than one tile, so its program
runs the loop body once: the instruction count is close to what one program executes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

R, AGENTS, D = 8, 32, 256

_SPY = r"""
import json, os, torch
from polykv.codecs import get_codec
from polykv.kernels import dispatch, triton_decode as td
seen, launch = [], td.cached_launch
def spy(kernel, grid, *args, plan=0, **kw):
    if kernel is td._phase_decode_kernel:
        seen.append(dict(grid=list(grid), args=[["tensor", str(a.dtype)[6:]] if isinstance(a, torch.Tensor)
                                                 else [type(a).__name__, a] for a in args], kw=kw))
    return launch(kernel, grid, *args, plan=plan, **kw)
td.cached_launch = spy
g = torch.Generator().manual_seed(0)
"""
_SEGMENT = _SPY + r"""
R, N, D = %d, %d, %d
rc = get_codec("q8_0", D)
k, v = (rc.encode(torch.randn(N, 1, R, D, generator=g)) for _ in range(2))
dispatch.attention_decode(torch.randn(N, 4, 1, D, generator=g), k, v, rc, rc, window=R,
                          kv_start=torch.zeros(N, dtype=torch.int32))
print(json.dumps(seen[0]))
""" % (R, AGENTS, D)
# one sequence on a Llama-8B layer; 256 keys: the build depends on the shapes only through
# Triton's specialisation of the integer arguments, and the interpreter runs the launch
_DECODE = _SPY + r"""
kc, vc = get_codec(%r, 128), get_codec(%r, 128)
k, v = (c.encode(torch.randn(1, 8, 256, 128, generator=g)) for c in (kc, vc))
dispatch.attention_decode(torch.randn(1, 32, 1, 128, generator=g), k, v, kc, vc)
print(json.dumps(seen[0]))
"""

_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int8": "*i8", "uint8": "*u8",
          "int32": "*i32", "int64": "*i64"}
OPCODES = ("HMMA", "LDG", "LDS", "STS", "PRMT", "HADD2", "FFMA", "FMUL", "MUFU", "LDL", "STL")


def record(pair: str | None = None) -> dict:
    """The phase kernel's launch as polykv makes it (interpreter subprocess): the segment pass, or
    with pair "K/V" one sequence's decode in that pair."""
    env = dict(os.environ, TRITON_INTERPRET="1", POLYKV_TRITON_ON_CPU="1")
    code = _SEGMENT if pair is None else _DECODE % tuple(pair.split("/"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def build(launch: dict, block_n: int, pair: str | None = None) -> dict:
    """Compile the recorded launch for sm_90 with BLOCK_N = block_n and the PTX decode strings of
    the pair's codecs (q8_0 for the segment); SASS figures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..codecs import get_codec
    from ..kernels import triton_decode as td
    from ..kernels.triton_codec import asm_strings

    fn = td._phase_decode_kernel
    names = fn.arg_names
    sig, consts, attrs = {}, {}, {}
    for i, (kind, val) in enumerate(launch["args"]):  # Triton's specialisation of each argument
        name = names[i]
        if kind == "tensor":
            sig[name], attrs[(i,)] = _TYPES[val], [["tt.divisibility", 16]]
        elif kind == "int" and val == 1:
            sig[name], consts[name] = "constexpr", 1
        elif kind == "int":
            sig[name] = "i32"
            if val % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    kw = {k: v for k, v in launch["kw"].items() if k not in ("plan", "launch_pdl")}
    options = dict(num_warps=kw.pop("num_warps"), num_stages=kw.pop("num_stages"))
    kname, vname = ("q8_0", "q8_0") if pair is None else pair.split("/")
    d = D if pair is None else 128
    ka, va = asm_strings(get_codec(kname, d)), asm_strings(get_codec(vname, d))  # the GPU's dec="auto"
    kw.update(BLOCK_N=block_n, K_DEC=1, V_DEC=1, PDL=True, **{f"KA{i}": ka[i] for i in range(8)},
              **{f"VA{i}": va[i] for i in range(8)})
    for k, v in kw.items():
        sig[k], consts[k] = "constexpr", v
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass, usage = (subprocess.run([os.path.join(tools, "cuobjdump"), flag, f.name], capture_output=True,
                                      text=True, check=True).stdout for flag in ("-sass", "-res-usage"))
    ops = [re.sub(r"@!?U?P\w+\s+", "", m) for m in re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]+);", sass)]
    ops = [o for o in ops if o.split()[0] != "NOP"]  # alignment padding, never executed
    regs = re.search(r"REG:(\d+)", usage)
    return dict(block_n=block_n, instructions=len(ops), registers=int(regs.group(1)) if regs else None,
                **{op: sum(o.split()[0].startswith(op) for o in ops) for op in OPCODES})


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-n", default="64,16")
    ap.add_argument("--decode", default=None, metavar="K/V",
                    help="one sequence's decode in this pair (e.g. turbo4/turbo3) instead of the segment")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    launch = record(a.decode)
    print(f"recorded: grid {launch['grid']}, BLOCK_N {launch['kw']['BLOCK_N']}, "
          f"num_warps {launch['kw']['num_warps']}", flush=True)
    rows = [build(launch, int(b), a.decode) for b in a.block_n.split(",") if b]
    for r in rows:
        print(r, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(decode=a.decode, launch_kw={k: v for k, v in launch["kw"].items() if not k[:2] in ("KA", "VA")},
                           grid=launch["grid"], rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
