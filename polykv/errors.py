"""Typed errors of polykv: what went wrong, as a type, so callers branch on the class and never on
message text or class names (the HTTP server maps each one to a status in one table,
`polykv/server/errors.py`). Importable without torch or transformers.

    PolykvError
    ├── PoolError (RuntimeError)                invalid pool operation
    │   ├── UnknownDocumentError (KeyError)     no document with that id
    │   └── DocumentInUseError                  open agent batches hold the document
    ├── BudgetExceededError                     admitting the work would exceed a KV byte budget
    ├── InvalidRequestError (ValueError)        a request's parameters are invalid
    ├── QueueFullError (RuntimeError)           too many requests waiting; retry later
    └── EngineClosedError (RuntimeError)        the engine is shutting down or has stopped

The second bases keep older code working: `except KeyError` around a document lookup,
`except ValueError` around parameter checks, `except RuntimeError` around the engine.
"""

from __future__ import annotations

__all__ = [
    "BudgetExceededError",
    "DocumentInUseError",
    "EngineClosedError",
    "InvalidRequestError",
    "PolykvError",
    "PoolError",
    "QueueFullError",
    "UnknownDocumentError",
]


class PolykvError(Exception):
    """Base of every typed polykv error."""


class PoolError(PolykvError, RuntimeError):
    """Invalid pool operation (unknown document, document in use, ...)."""


class UnknownDocumentError(PoolError, KeyError):
    """No document with that id (never added, removed, or a typo)."""

    def __init__(self, message: str, document=None):
        super().__init__(message)
        self.document = document

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class DocumentInUseError(PoolError):
    """The document is referenced by open agent batches (or queued requests)."""


class BudgetExceededError(PolykvError):
    """Admitting this request (or adding this document) would exceed the KV byte budget.
    `used` and `budget` are measured bytes where known (None otherwise)."""

    def __init__(self, message: str, used: int | None = None, budget: int | None = None):
        super().__init__(message)
        self.used, self.budget = used, budget


class InvalidRequestError(PolykvError, ValueError):
    """A request's parameters are invalid (the message names the parameter)."""


class QueueFullError(PolykvError, RuntimeError):
    """Too many requests waiting; retry later."""


class EngineClosedError(PolykvError, RuntimeError):
    """The engine is shutting down or has stopped."""
