"""Residency probe (GPU): registers, shared memory and resident programs per SM of the compiled
decode kernels, and the 64k decode time at several program counts with the driver's default
shared-memory carveout and with the carveout preference set to the maximum.

Usage (repo root, CUDA machine): PYTHONPATH=. python3 polykv/bench/residency.py
Writes $OUT/residency.json (or ./residency.json).
"""

from __future__ import annotations

import ctypes
import json
import os

import torch

from polykv.bench.attention import bench_one
from polykv.kernels import triton_decode as td

CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


def compiled(fn):
    """Every compiled variant of a Triton kernel on this process's devices."""
    for cache, *_ in fn.device_caches.values():
        yield from cache.values()


def occupancy(lib, k) -> int:
    n = ctypes.c_int()
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(k.function), ctypes.c_int(k.metadata.num_warps * 32),
        ctypes.c_size_t(k.metadata.shared))
    return n.value


def main() -> dict:
    lib = ctypes.CDLL("libcuda.so.1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict = {"rows": [], "kernels": []}
    pairs = (("q8_0", "turbo3"), ("turbo3", "turbo3"))
    per_sm = (8, 12, 16)
    for carveout in (None, 100):
        for kn, vn in pairs:
            for n in per_sm:
                r = bench_one(65536, 1, kn, vn, sdpa=False,
                              tune=dict(impl="phase", target_programs=n * sms))
                row = dict(pair=f"{kn}/{vn}", programs_per_sm=n, carveout=carveout, us=r["ms"] * 1e3)
                res["rows"].append(row)
                print(row, flush=True)
        for k in compiled(td._phase_decode_kernel):
            k._init_handles()
            res["kernels"].append(dict(carveout=carveout, regs=k.n_regs, spills=k.n_spills,
                                       shared=k.metadata.shared,
                                       resident_per_sm=occupancy(lib, k)))
            lib.cuFuncSetAttribute(ctypes.c_void_p(k.function),
                                   CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
    for kinfo in res["kernels"]:
        print(kinfo)
    with open(os.path.join(os.environ.get("OUT", "."), "residency.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
