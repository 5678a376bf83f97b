"""HTTP API (FastAPI): documents, OpenAI-compatible completions over shared prefixes, status, metrics."""

from .app import create_app
from .runner import ServerThread, build_pool, free_port, serve

__all__ = ["ServerThread", "build_pool", "create_app", "free_port", "serve"]
