"""Per-sequence compressed KV storage and byte accounting."""

from .accounting import storage_bytes
from .layer import CompressedLayer
from .slots import SlotRows

__all__ = ["CompressedLayer", "SlotRows", "storage_bytes"]
