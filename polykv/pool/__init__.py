"""SharedKVPool: documents, refcounts, budget + LRU eviction, persistence (safetensors + manifest).

Nothing here imports transformers at module load (the Cache subclasses live in agent_cache.py and
are imported on first use)."""

from .agents import AgentBatch
from .pool import DocumentInUseError, PoolError, PoolFormatError, SharedKVPool

__all__ = ["AgentBatch", "DocumentInUseError", "PoolError", "PoolFormatError", "SharedKVPool"]
