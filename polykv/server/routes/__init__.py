"""The app's routers, one per concern (documents, OpenAI-compatible completions, operations)."""

from .completions import router as completions
from .documents import router as documents
from .ops import router as ops

__all__ = ["completions", "documents", "ops"]
