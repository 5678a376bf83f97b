"""Scheduling agents: continuous batching across documents, per-request sampling, streaming."""

from .dense import DenseBatch, DensePool
from .engine import Engine, EngineClosedError, Event, GenerationRequest, KVBudgetExceeded, QueueFullError, RequestHandle
from ..generation import Sampler, SamplingParams, StopChecker, sample_token

__all__ = [
    "DenseBatch",
    "DensePool",
    "Engine",
    "EngineClosedError",
    "Event",
    "GenerationRequest",
    "KVBudgetExceeded",
    "QueueFullError",
    "RequestHandle",
    "Sampler",
    "SamplingParams",
    "StopChecker",
    "sample_token",
]
