"""Compressed K/V storage of one attention layer whose KV heads are stored at different types.

Issue K's presets may mix types per KV head: in SmolLM2 a layer's sensitivity is mostly one head's
(layer 18's K error at turbo3 is 33.1 of its 33.6 x 10^-4 nats in head 2; docs/quality.md, "Per-head
types, simulated"), so a budget buys precision for that head instead of for the whole layer.

The codecs encode each head's rows on their own (one row of head_dim values, its own scale / norm),
so heads of one type need nothing from heads of another: the layer is one `CompressedLayer` per
distinct (K, V) pair over the heads that hold it. Writes gather each group's heads; reads decode
every group in true space and scatter its heads back into place. There is no rotated read: heads of
one layer may be stored in different domains (turbo: rotated, q8_0: not), so a mixed layer attends
in true space (`PolyKVLayer.attends_rotated`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..codecs import get_codec
from .accounting import storage_bytes
from .layer import CompressedLayer


def head_groups(head_types: Sequence[tuple[str, str]]) -> list[tuple[tuple[str, str], list[int]]]:
    """[((k, v), heads)] in order of each pair's first head: the heads stored at each K/V pair."""
    groups: dict[tuple[str, str], list[int]] = {}
    for h, (k, v) in enumerate(head_types):
        groups.setdefault((str(k), str(v)), []).append(h)
    return list(groups.items())


class HeadGroupedLayer:
    """Packed K and V rows of one layer, leading shape [batch, kv_heads, capacity], each KV head at
    its own (K, V) type: one `CompressedLayer` per distinct pair (module docstring).

    head_types: [kv_heads] (k, v) codec names, e.g. [("turbo3", "turbo2")] * 2 + [("q8_0", "turbo3")].
    key_scales: InnerQ scales float32 [kv_heads, head_dim] or None; a group gets its heads' rows of
        them when its K is a turbo type (InnerQ applies to turbo keys only)."""

    def __init__(self, head_types: Sequence[tuple[str, str]], head_dim: int, batch: int,
                 device: torch.device | str | None = None, key_scales: torch.Tensor | None = None):
        self.head_types = tuple((str(k), str(v)) for k, v in head_types)
        self.kv_heads, self.head_dim, self.batch = len(self.head_types), int(head_dim), int(batch)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if key_scales is not None and tuple(key_scales.shape) != (self.kv_heads, self.head_dim):
            raise ValueError(f"key_scales {tuple(key_scales.shape)}, expected ({self.kv_heads}, {self.head_dim})")
        self.groups: list[tuple[list[int], torch.Tensor, CompressedLayer]] = []
        for (k, v), heads in head_groups(self.head_types):
            k_codec = get_codec(k, self.head_dim)
            scales = key_scales[heads] if key_scales is not None and k_codec.rotated else None
            index = torch.tensor(heads, dtype=torch.long, device=self.device)
            self.groups.append((heads, index, CompressedLayer(k_codec, get_codec(v, self.head_dim),
                                                              self.batch, len(heads), self.device, scales)))

    # --- rows --------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.groups[0][2].length

    @length.setter
    def length(self, n: int) -> None:
        for _, _, g in self.groups:
            g.length = n

    @property
    def capacity(self) -> int:
        return self.groups[0][2].capacity

    def reserve(self, needed: int, exact: bool = False) -> None:
        for _, _, g in self.groups:
            g.reserve(needed, exact)

    def compact(self) -> None:
        for _, _, g in self.groups:
            g.compact()

    # --- writes ------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and append rows: k, v [batch, kv_heads, S, head_dim] (true space, unscaled)."""
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != self.batch or k.shape[1] != self.kv_heads:
            raise ValueError(f"expected K/V [{self.batch}, {self.kv_heads}, S, {self.head_dim}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        for _, index, g in self.groups:
            g.append(k.index_select(1, index.to(k.device)), v.index_select(1, index.to(v.device)))

    def write_at(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """As `CompressedLayer.write_at`, each group its heads."""
        for _, index, g in self.groups:
            g.write_at(k.index_select(1, index.to(k.device)), v.index_select(1, index.to(v.device)), positions)

    def trim(self, keep: int) -> None:
        for _, _, g in self.groups:
            g.trim(keep)

    def truncate(self, length: int) -> None:
        for _, _, g in self.groups:
            g.truncate(length)

    def select_batch(self, index: torch.Tensor) -> None:
        for _, _, g in self.groups:
            g.select_batch(index)
        self.batch = int(index.numel())

    # --- reads -------------------------------------------------------------------------------
    def decode_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32,
                    rotated: tuple[bool, bool] = (False, False)) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows [start, stop) -> true-space (k, v) [batch, kv_heads, stop-start, head_dim] in
        `dtype`, keys unscaled. rotated must be (False, False): the heads' storage domains differ."""
        if any(rotated):
            raise ValueError("a layer with per-head types decodes in true space only (its heads are "
                             "stored in different domains); attend with rotated=(False, False)")
        parts = [(index, g.decode_rows(start, stop, dtype)) for _, index, g in self.groups]
        n = parts[0][1][0].shape[2]
        k = torch.empty(self.batch, self.kv_heads, n, self.head_dim, dtype=dtype, device=self.device)
        v = torch.empty_like(k)
        for index, (gk, gv) in parts:
            k.index_copy_(1, index, gk)
            v.index_copy_(1, index, gv)
        return k, v

    def dense(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded true-space (k, v), [batch, kv_heads, length, head_dim]; keys unscaled."""
        return self.decode_rows(0, self.length, dtype)

    # --- bytes -------------------------------------------------------------------------------
    def used_nbytes(self) -> int:
        """Payload bytes of the `length` stored rows of every group (capacity slack excluded)."""
        return sum(g.used_nbytes() for _, _, g in self.groups)

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, _, g in self.groups for t in g.tensors()]

    def nbytes(self) -> int:
        """Measured bytes of every group's packed storage (allocated capacity included)."""
        return storage_bytes(self.tensors())


__all__ = ["HeadGroupedLayer", "head_groups"]
