"""Where polykv keeps its on-disk caches: the one meaning of ``$POLYKV_CACHE_DIR``.

    $POLYKV_CACHE_DIR (unset or empty: ~/.cache/polykv; "~" expanded)
        models/      converted GGUF models (`polykv.hf.gguf`)
        codebooks/   Lloyd-Max codebooks (`polykv.codecs.turbo`)
        innerq/      calibrated InnerQ tables (`polykv.hf.fingerprint.innerq_path`)
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$POLYKV_CACHE_DIR, or ~/.cache/polykv when it is unset or empty (not created)."""
    env = os.environ.get("POLYKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "polykv"


def cache_dir(*parts: str) -> Path:
    """`cache_root()` joined with parts; created on demand."""
    p = cache_root().joinpath(*parts)
    p.mkdir(parents=True, exist_ok=True)
    return p
