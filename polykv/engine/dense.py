"""Dense (uncompressed) agent batches: the engine's path for requests without a document.

:class:`DenseBatch` implements the AgentBatch protocol the engine drives
(``add / step / feed / remove / len / close``) on plain transformers ``DynamicCache`` objects, one
per agent. It is used for plain requests (no shared document), and :class:`DensePool` wraps it as a
small reference pool (documents prefilled once, copied per agent: the *naive* layout) for tests and
as a fallback when the shared compressed pool is not available.
"""

from __future__ import annotations

import copy
import itertools
import threading

import torch

from ..errors import BudgetExceededError, DocumentInUseError, UnknownDocumentError

__all__ = ["DenseBatch", "DensePool", "DocumentInUseError", "UnknownDocumentError"]


def _cache_bytes(cache) -> int:
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
    return total


class _Agent:
    __slots__ = ("cache", "pending", "pos")

    def __init__(self, cache, pending: list[int], pos: int):
        self.cache = cache
        self.pending = pending  # tokens to run through the model at the next step
        self.pos = pos  # tokens already in the cache


class DenseBatch:
    """Agents over an optional dense prefix cache; each agent has a private DynamicCache.

    ``step()`` runs every agent with pending input (its prompt the first time, then the fed token)
    and returns ``{aid: float32 logits [vocab]}`` for them.
    """

    def __init__(self, model, prefix_cache=None, prefix_len: int = 0, prefix_last_logits=None,
                 on_close=None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.prefix_len = prefix_len
        self.prefix_last_logits = prefix_last_logits
        self._agents: dict[int, _Agent] = {}
        self._ids = itertools.count()
        self._on_close = on_close
        self.closed = False

    def __len__(self) -> int:
        return len(self._agents)

    def add(self, prompt_ids) -> int:
        ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        if not ids and self.prefix_len == 0:
            raise ValueError("an agent without a document needs a non-empty prompt")
        from transformers import DynamicCache

        cache = copy.deepcopy(self.prefix_cache) if self.prefix_cache is not None else DynamicCache()
        aid = next(self._ids)
        self._agents[aid] = _Agent(cache, ids, self.prefix_len)
        return aid

    def remove(self, aid: int) -> None:
        self._agents.pop(aid, None)

    def feed(self, tokens: dict[int, int]) -> None:
        for aid, tok in tokens.items():
            self._agents[aid].pending.append(int(tok))

    @torch.inference_mode()
    def step(self) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for aid, a in self._agents.items():
            if not a.pending:
                if a.pos == self.prefix_len and self.prefix_last_logits is not None:
                    out[aid] = self.prefix_last_logits.clone()  # empty prompt: next token after doc
                continue
            ids = torch.tensor([a.pending], dtype=torch.long, device=self.model.device)
            pos = torch.arange(a.pos, a.pos + ids.shape[1], device=ids.device).unsqueeze(0)
            res = self.model(input_ids=ids, position_ids=pos, past_key_values=a.cache, use_cache=True,
                             logits_to_keep=1)
            a.pos += ids.shape[1]
            a.pending = []
            out[aid] = res.logits[0, -1].float().cpu()
        return out

    def close(self) -> None:
        self._agents.clear()
        if not self.closed and self._on_close is not None:
            self._on_close(self)
        self.closed = True

    def kv_bytes(self) -> int:
        return sum(_cache_bytes(a.cache) for a in self._agents.values())


class DensePool:
    """Reference pool with the SharedKVPool surface, storing every document as a dense f32 cache
    and copying it into each agent (no sharing, no compression). For tests and as a fallback."""

    def __init__(self, model, tok, k: str = "f16", v: str = "f16", device=None, budget_bytes=None):
        self.model, self.tok = model, tok
        self.k, self.v = k, v
        self.budget_bytes = budget_bytes
        self._docs: dict[str, dict] = {}
        self._open: dict[str, set] = {}
        self._n = itertools.count(1)
        self._lock = threading.Lock()

    @torch.inference_mode()
    def add_document(self, text_or_ids, name: str | None = None) -> str:
        from transformers import DynamicCache

        if isinstance(text_or_ids, str):
            ids = self.tok(text_or_ids, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in text_or_ids]
        if not ids:
            raise ValueError("document is empty")
        cache = DynamicCache()
        x = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        res = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nbytes = _cache_bytes(cache)
        if self.budget_bytes is not None and self._used() + nbytes > self.budget_bytes:
            raise BudgetExceededError(f"KV budget exceeded: need {nbytes} bytes, "
                                      f"{self.budget_bytes - self._used()} free of {self.budget_bytes}",
                                      used=self._used() + nbytes, budget=self.budget_bytes)
        doc_id = f"doc-{next(self._n)}"
        self._docs[doc_id] = {"id": doc_id, "name": name or doc_id, "tokens": len(ids), "bytes": nbytes,
                              "cache": cache, "last": res.logits[0, -1].float().cpu()}
        self._open[doc_id] = set()
        return doc_id

    def _used(self) -> int:
        return sum(d["bytes"] for d in self._docs.values())

    def remove_document(self, doc_id: str) -> None:
        if doc_id not in self._docs:
            raise UnknownDocumentError(f"unknown document {doc_id!r}", doc_id)
        if any(len(b) for b in self._open[doc_id]):
            raise DocumentInUseError(f"document {doc_id!r} is in use")
        del self._docs[doc_id]
        del self._open[doc_id]

    def documents(self) -> list[dict]:
        return [{k: d[k] for k in ("id", "name", "tokens", "bytes")} for d in self._docs.values()]

    def open_batch(self, doc_id: str) -> DenseBatch:
        if doc_id not in self._docs:
            raise UnknownDocumentError(f"unknown document {doc_id!r}", doc_id)
        d = self._docs[doc_id]
        batch = DenseBatch(self.model, d["cache"], d["tokens"], d["last"],
                           on_close=lambda b: self._open.get(doc_id, set()).discard(b))
        self._open[doc_id].add(batch)
        return batch

    def memory_report(self) -> dict:
        shared = self._used()
        agents = {k: sum(len(b) for b in v) for k, v in self._open.items()}
        naive = shared  # one dense copy per document, measured (the agents' own copies: kv_bytes_agents)
        private = sum(b.kv_bytes() for v in self._open.values() for b in v)
        return {"kv_bytes_shared": shared, "kv_bytes_agents": private, "kv_bytes_naive_f16": naive,
                "agents": sum(agents.values()), "documents": len(self._docs)}
