"""The warp-specialised cascade prefix pass (kernels/gluon_prefix.py) on the CPU.

Gluon kernels do not run in Triton's interpreter: here the kernel is built offline for sm_90
(Triton's bundled ptxas), which checks that every variant compiles, fits its register budget
and spills nothing; its values are checked against kernels/reference.py at full size on the GPU
(polykv/bench/gpu_suite.py: "cascade ws ..." rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton

from polykv.codecs import get_codec
from polykv.kernels import gluon_prefix as gp
from polykv.kernels.triton_codec import ASM_Q8, asm_strings

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

VARIANTS = [  # (block_m, even, maxnreg, consumer_regs, ping): gluon_prefix's defaults
    (128, True, 168, gp.CONSUMER_REGS[128], True),   # 32-64 agents: two consumer groups in turns
    (128, False, 168, gp.CONSUMER_REGS[128], True),  # a prefix length not a multiple of the key tile
    (128, True, 168, gp.CONSUMER_REGS[128], False),  # one consumer partition (ping=False)
    (64, True, 128, gp.CONSUMER_REGS[64], False),    # up to 16 agents: two CTAs per SM
]

# Run in a fresh interpreter: the tests' process runs Triton in interpreter mode
# (TRITON_INTERPRET=1, fixed at import), under which Gluon kernels cannot be compiled.
BUILD = r"""
import json, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from polykv.codecs import get_codec
from polykv.kernels import gluon_prefix as gp
from polykv.kernels.triton_codec import ASM_Q8, asm_strings

BIN = sys.argv[1]
va = [gp.unpacked(a) for a in asm_strings(get_codec("turbo3", 128))]
names = gp._ws_prefix_kernel.arg_names
out = []
for block_m, even, maxnreg, consumer_regs, ping in json.loads(sys.argv[2]):
    sig = dict(Q="*fp16", KC="*i8", KS="*fp16", VC="*u8", VS="*fp16", KV_LENS="*i32",
               O_PART="*fp32", L_PART="*fp32", qk_scale="fp32")
    for n in "skh sks sksh skss svh svs svsh svss sqn sqh sqm M_AGENT M_TOTAL SPLIT_LEN N_SPLITS SPLIT0".split():
        sig[n] = "i32"
    consts = dict(D=128, BLOCK_M=block_m, BLOCK_N=64, NBUF=3, KA=gp.unpacked(ASM_Q8),
                  CREG=consumer_regs, PREFETCH=True, PIPE=True, EVEN=even, PING=ping,
                  **{f"VA{i}": va[i] for i in range(8)})
    sig.update({k: "constexpr" for k in consts})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in ("skh", "sks", "svh", "svs", "SPLIT_LEN")}
    src = GluonASTSource(gp._ws_prefix_kernel, sig,
                         {(names.index(k),): v for k, v in consts.items()}, attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=4, num_stages=1, maxnreg=maxnreg))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([BIN + "/cuobjdump", "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    out.append(dict(hgmma="HGMMA" in sass, mbarriers="SYNCS.ARRIVE" in sass and
                    "SYNCS.PHASECHK" in sass,
                    consumer_partitions=len(re.findall(
                        rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP0, 0x{consumer_regs:x}(?![0-9a-f])", sass)),
                    spills=len(re.findall(r"\b(?:LDL|STL)\b", sass))))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def builds():
    if not (BIN / "ptxas").exists():
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", BUILD, str(BIN), json.dumps(VARIANTS)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(VARIANTS)), ids=[str(v) for v in VARIANTS])
def test_kernel_builds_for_sm90_without_spills(builds, i):
    b = builds[i]
    assert b["hgmma"]  # the dots are wgmma (tensor cores, operands from shared memory)
    assert b["mbarriers"]  # producer / consumer hand-offs through mbarriers
    # the consumer partition(s) got their register budget (setmaxnreg): two taking turns with ping
    assert b["consumer_partitions"] == (2 if VARIANTS[i][4] else 1)
    assert b["spills"] == 0, "register spills"


def test_unpacked_rewrites_operands():
    """The byte-pack lookups are rewritten for one word per element: inputs $4, $5 and outputs
    $0..$3, byte j of the word in output j (the two fp16 pairs split in order)."""
    for asm in [ASM_Q8, *filter(None, asm_strings(get_codec("turbo3", 128)))]:
        out = gp.unpacked(asm)
        body = asm.strip()[1:-1]
        assert "$2" not in out.replace("{$2, $3}", "")  # the old inputs are gone...
        assert ("$3" in body) == ("$5" in out) and "$4" in out  # ...renamed in order
        assert out.endswith("mov.b32 {$0, $1}, o0t; mov.b32 {$2, $3}, o1t; }")
        assert out.count("o0t") == body.count("$0") + 2  # declared and unpacked once each


def test_ws_ok_selects_hopper_q8_turbo3_prefix(monkeypatch):
    kc, vc = get_codec("q8_0", 128), get_codec("turbo3", 128)
    cpu = torch.zeros(1, 8, 128, 128)
    assert not gp.ws_ok(cpu, kc, vc)  # not on the CPU

    def fake(shape, last_stride=1):  # the query rows [N agents, Hkv, M, D]
        return SimpleNamespace(shape=torch.Size(shape), is_cuda=True, device=torch.device("cuda"),
                               stride=lambda dim: last_stride)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not gp.ws_ok(fake((1, 8, 128, 128)), kc, vc)  # nor in the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gp.ws_ok(fake((1, 8, 128, 128)), kc, vc)
    assert gp.ws_ok(fake((1, 8, 17, 128)), kc, vc)
    assert not gp.ws_ok(fake((1, 8, 16, 128)), kc, vc)  # decode-sized: the phase kernel
    assert gp.ws_ok(fake((5, 8, 4, 128)), kc, vc)  # 5 agents x 4 rows per KV head
    assert not gp.ws_ok(fake((4, 8, 4, 128)), kc, vc)  # 16 rows: the phase kernel
    assert not gp.ws_ok(fake((5, 8, 4, 128), last_stride=2), kc, vc)  # rows read in place
    assert not gp.ws_ok(fake((1, 8, 128, 128)), get_codec("turbo4", 128), vc)
    assert not gp.ws_ok(fake((1, 8, 128, 128)), kc, get_codec("turbo4", 128))
    assert not gp.ws_ok(fake((1, 8, 128, 64)), get_codec("q8_0", 64), get_codec("turbo3", 64))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not gp.ws_ok(fake((1, 8, 128, 128)), kc, vc)  # Hopper's wgmma only
