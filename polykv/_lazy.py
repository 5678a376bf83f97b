"""Lazy re-exports: packages name their public objects without importing heavy modules
(transformers, triton) until first use."""

from __future__ import annotations

import importlib


def lazy_getattr(package: str, table: dict[str, tuple[str, str]], namespace: dict):
    """A module-level `__getattr__` resolving `table[name] = (module, attribute)` on first access and
    caching the result in the package `namespace`."""

    def __getattr__(name: str):
        if name in table:
            module, attr = table[name]
            value = getattr(importlib.import_module(module), attr)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
