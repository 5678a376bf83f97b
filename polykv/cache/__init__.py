"""Per-sequence compressed KV storage and byte accounting."""

from .accounting import storage_bytes
from .layer import CompressedLayer

__all__ = ["CompressedLayer", "storage_bytes"]
