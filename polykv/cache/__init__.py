"""Per-sequence compressed KV storage and byte accounting."""

from .accounting import storage_bytes
from .heads import HeadGroupedLayer, head_groups
from .layer import CompressedLayer
from .pages import PagedRows, PageTable
from .ring import RecentRing

__all__ = ["CompressedLayer", "HeadGroupedLayer", "PageTable", "PagedRows", "RecentRing", "head_groups", "storage_bytes"]
