"""Byte accounting from real tensors (DESIGN §7): each storage counted once."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Sum of untyped_storage().nbytes() over the distinct storages behind `tensors`."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total
