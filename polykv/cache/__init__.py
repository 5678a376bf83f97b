"""Per-sequence compressed KV storage and byte accounting."""

from .accounting import storage_bytes
from .layer import CompressedLayer
from .pages import PagedRows, PageTable
from .ring import RecentRing

__all__ = ["CompressedLayer", "PageTable", "PagedRows", "RecentRing", "storage_bytes"]
