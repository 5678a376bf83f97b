"""Kernel launches that skip Triton's per-call dispatch once a specialisation has been compiled.

    launch(_combine_kernel, (rows,), o, lse, ..., D=D, NSP_P2=8)   # as _combine_kernel[(rows,)](...)

Triton's `fn[grid](*args, **kw)` binds every argument, builds a cache key from the specialisation
of each one (dtype, 16-byte alignment of pointers, integers equal to 1 or divisible by 16) and the
values of the constexprs, checks the kernel's globals and looks up the stream, on every call: for
kernels of 30-70 arguments that is tens of µs per launch, paid by every eager attention call (issue
F). `launch` keys the compiled kernel on the same specialisation, computed directly from the
arguments, and calls its launcher.

Contract of the call sites: runtime (non-constexpr) arguments positional, in signature order;
constexprs and launch options (num_warps, ...) as keywords with hashable values. Anything else —
the interpreter, a launch hook installed (profilers), `enabled` False — takes Triton's own path.
"""

from __future__ import annotations

import os

import torch

enabled = os.environ.get("POLYKV_LAUNCH_CACHE", "1") != "0"
"""Module switch (A/B timing, debugging): False sends every launch through Triton's own path."""

_I32 = (-(1 << 31), 1 << 31)


def arg_spec(a):
    """What Triton specialises a runtime argument on, as a hashable value: tensors by dtype and
    16-byte alignment; ints by == 1 (a constexpr), divisibility by 16 and width (i32 / i64 / u64);
    floats, bools and None by type. Anything else raises TypeError (the caller then takes Triton's
    path: a NumPy integer, say, is specialised by value)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    t = type(a)
    if t is int:
        return a == 1, not a & 15, _I32[0] <= a < _I32[1], a < 1 << 63
    if t in (float, bool) or a is None:
        return t
    raise TypeError(f"no launch-cache key for {t.__name__} arguments")


class _Entry:
    """A compiled kernel's launch: run(gx, gy, gz, stream, function, *head, *args, *tail).
    Kernels that need no scratch memory are launched by the compiled launcher itself (head: its
    cooperative / PDL flags, no scratch buffers, the metadata, no hooks): Triton's Python wrapper
    around it only allocates scratch buffers, two closures per launch that cost host time."""

    __slots__ = ("run", "function", "head", "tail")

    def __init__(self, kernel, tail: list):
        runner, meta = kernel.run, kernel.packed_metadata
        self.function, self.tail = kernel.function, tail
        direct = getattr(runner, "launch", None)
        if (direct is not None and getattr(runner, "global_scratch_size", 1) == 0
                and getattr(runner, "profile_scratch_size", 1) == 0):
            self.run = direct
            self.head = (runner.launch_cooperative_grid, runner.launch_pdl, None, None, meta,
                         None, None, None)
        else:
            self.run, self.head = runner, (meta, None, None, None)


_CACHE: dict = {}
MAX_ENTRIES = 4096
"""Entries kept in each cache (this module's, triton_decode's plans) before it is cleared."""


def _tail(fn, n_pos: int, consts: dict) -> list:
    """The values of the parameters after the first n_pos, in signature order (keyword or default)."""
    out = []
    for p in fn.params[n_pos:]:
        if p.name in consts:
            out.append(consts[p.name])
        elif p.has_default:
            out.append(p.default)
        else:
            raise TypeError(f"{fn.__name__}: no value for parameter {p.name}")
    return out


def _hooked(runtime) -> bool:
    """Whether a launch hook is installed (a profiler): Triton 3.6 keeps them in HookChains,
    empty unless one was added."""
    return any(h is not None and getattr(h, "calls", True)
               for h in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def launch(fn, grid: tuple, *args, plan: int = 0, **consts):
    """fn[grid](*args, **consts), through the compiled-kernel cache where it applies.
    plan=n > 0: returns a `Planned` launch taking the first n arguments (tensors) anew and keeping
    the rest, or None where the cache does not apply (the caller then launches this way again)."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if not enabled or not isinstance(fn, JITFunction) or _hooked(knobs.runtime):
        fn[grid](*args, **consts)
        return None
    dev = driver.active.get_current_device()
    try:
        key = (fn, dev, tuple(map(arg_spec, args)), tuple(consts.items()))
    except TypeError:
        fn[grid](*args, **consts)
        return None
    g3 = tuple(grid) + (1,) * (3 - len(grid))
    e = _CACHE.get(key)
    if e is None:
        kernel = fn[grid](*args, **consts)  # compiles (or finds) the kernel, and launches it
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        if len(_CACHE) >= MAX_ENTRIES:  # shapes seen over a long run: start over, never grow unbounded
            _CACHE.clear()
        e = _CACHE[key] = _Entry(kernel, _tail(fn, len(args), consts))
    else:
        e.run(*g3, driver.active.get_current_stream(dev), e.function, *e.head, *args, *e.tail)
    return Planned(e, g3, (*args[plan:], *e.tail), dev, driver.active.get_current_stream) if plan else None


class Planned:
    """A launch with everything but its leading tensors bound: `planned(*tensors)` launches the
    same compiled kernel, grid and other arguments on new tensors. The caller keys its plans on
    whatever decides those (shapes, strides, dtypes, alignment of the tensors): nothing is
    checked per call, launch hooks included (a profiler installed later sees Triton-path launches
    only: set `enabled = False` to profile through hooks)."""

    __slots__ = ("run", "function", "head", "grid", "static", "dev", "stream", "kept")

    def __init__(self, e: _Entry, grid: tuple, static: tuple, dev, stream):
        self.run, self.function, self.head = e.run, e.function, e.head
        self.grid, self.dev, self.stream = grid, dev, stream
        # the kept tensors go to the launcher as their addresses: for a tensor it calls data_ptr()
        # and asks the driver about the pointer (cuPointerGetAttribute) on every launch, for an
        # int neither; `kept` holds them alive
        self.kept = static
        self.static = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in static)

    def __call__(self, *tensors) -> None:
        g = self.grid
        self.run(g[0], g[1], g[2], self.stream(self.dev), self.function, *self.head, *tensors,
                 *self.static)
