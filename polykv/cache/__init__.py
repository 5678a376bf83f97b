"""Per-sequence compressed KV storage and byte accounting."""

from .accounting import storage_bytes
from .layer import CompressedLayer
from .pages import PagedRows, PageTable

__all__ = ["CompressedLayer", "PageTable", "PagedRows", "storage_bytes"]
