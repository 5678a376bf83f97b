"""Where polykv keeps its on-disk caches (converted models, codebooks, InnerQ tables)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """$POLYKV_CACHE_DIR (default ~/.cache/polykv) joined with parts; created on demand."""
    root = Path(os.environ.get("POLYKV_CACHE_DIR", Path.home() / ".cache" / "polykv"))
    p = root.joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
