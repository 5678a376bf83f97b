"""Server state shared by the routes: the engine, a mirror of the pool's documents (so lookups never
wait for a model step), memory reports and status."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time

from fastapi import Request

from ..engine import Engine
from ..errors import BudgetExceededError, DocumentInUseError
from .metrics import Metrics

__all__ = ["ServerState", "get_state"]

log = logging.getLogger("polykv.server")


def get_state(request: Request) -> "ServerState":
    """FastAPI dependency: the app's ServerState."""
    return request.app.state.polykv


class ServerState:
    """Everything the handlers share. Document metadata is mirrored here (updated on the engine
    thread's results) so lookups never wait for a model step."""

    def __init__(self, engine: Engine, *, model_name: str, k: str | None, v: str | None,
                 store: str | None, max_tokens_cap: int, context_length: int | None):
        self.engine = engine
        self.pool = engine.pool
        self.tok = engine.tok
        self.model_name = model_name
        self.model_names = {model_name, "polykv"}
        self.k, self.v = k, v
        self.store = store
        cfg = getattr(engine.model, "config", None)
        ctx = context_length or getattr(cfg, "max_position_embeddings", None) or 2048
        self.context_length = int(ctx)
        self.max_tokens_cap = min(int(max_tokens_cap), self.context_length)
        self.started = time.time()
        self.docs: dict[str, dict] = {}
        self._mem: dict = {}
        self._mem_at = 0.0
        self._mem_fut = None
        self._tok_hist: list[tuple[float, int]] = []
        self.prefills = 0  # document prefills run by the pool (adds and re-prefills of evicted documents)
        self._count_prefills()
        self.metrics = Metrics(self)

    def _count_prefills(self) -> None:
        """Count the pool's document prefills (`SharedKVPool._prefill`, the one place a document's
        KV is computed) by wrapping it on this pool instance; pools without it count nothing."""
        inner = getattr(self.pool, "_prefill", None)
        if inner is None or getattr(inner, "_polykv_counted", False):
            return

        def counted(*args, **kwargs):
            self.prefills += 1
            return inner(*args, **kwargs)

        counted._polykv_counted = True
        self.pool._prefill = counted

    # --- threads ----------------------------------------------------------------------------
    async def on_engine(self, fn, *args, timeout: float = 600.0):
        """Run `fn(*args)` on the engine thread between steps; its exceptions propagate."""
        return await asyncio.wait_for(asyncio.wrap_future(self.engine.call(fn, *args)), timeout)

    @staticmethod
    async def in_thread(fn, *args):
        """Run `fn(*args)` (tokenization, chat templates) on a worker thread, off the event loop."""
        return await asyncio.to_thread(fn, *args)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    # --- documents --------------------------------------------------------------------------
    def add_document(self, text: str, name: str | None) -> dict:
        """Engine thread: add (or find) a document; refused with BudgetExceededError (and a new
        document rolled back) when the KV bytes held would exceed the pool's budget."""
        known = {str(d["id"]) if isinstance(d, dict) else str(getattr(d, "id", d))
                 for d in (self.pool.documents() if hasattr(self.pool, "documents") else [])}
        self.refuse_unfittable(text, name)
        handle = self.pool.add_document(text, name=name)
        try:
            self.engine.check_budget(f"document {name or str(handle)!r}")
        except BudgetExceededError:
            if str(handle) not in known:  # roll back: nothing else could be evicted to make room
                self.pool.remove_document(handle)
            raise
        info = self.doc_info(handle, name)
        info["_handle"] = handle
        self.docs[info["id"]] = info
        self.save_store()
        return info

    def refuse_unfittable(self, text: str, name: str | None) -> None:
        """Engine thread, before the prefill: refuse (BudgetExceededError) a document that cannot
        fit even once every evictable document (resident, no open batch) is dropped, i.e. when its
        compressed bytes (`prefix_bytes`) + the bytes nothing can free (documents in use, agent
        suffixes, the plain batch) exceed the budget. The refusal after the prefill (`check_budget`)
        would be certain; this one costs no prefill (measured: 11 s for 2,200 SmolLM2 tokens on a
        2-core CPU, during which every stream stalls) and evicts nothing (the pool's own budget pass
        would evict the unused documents first). A document already resident costs nothing: never
        refused here. Pools without the needed surface (`_doc_tokens`, `layout`, `_docs`) skip it."""
        budget = getattr(self.pool, "budget_bytes", None)
        docs = getattr(self.pool, "_docs", None)
        if budget is None or not hasattr(self.pool, "_doc_tokens") or not isinstance(docs, dict):
            return
        ids = self.pool._doc_tokens(text)[0]
        if any(d.ids == ids and d.resident for d in list(docs.values())):
            return
        need = self.prefix_bytes(len(ids))
        if need is None:
            return
        used, _ = self.engine.kv_usage()
        # bytes the pool can free on the GPU for the new document: unreferenced documents there (they
        # move to the host tier or are evicted); a pool without tiers: every resident document
        evictable = sum(int(d["bytes"]) for d in self.pool.documents()
                        if d.get("tier", "gpu" if d["resident"] else "evicted") == "gpu" and not d["refs"])
        pinned = used - evictable
        if pinned + need > budget:
            raise BudgetExceededError(f"document {name or 'unnamed'!r} ({len(ids)} tokens) needs {need} bytes of KV "
                                      f"memory and {pinned} are held by documents in use and live agents; "
                                      f"budget_bytes={budget}", used=pinned + need, budget=budget)

    def prefix_bytes(self, tokens: int) -> int | None:
        """Compressed bytes of a document of `tokens` tokens, computed from the pool's KV layout and
        codecs (bytes per row measured on the codec's storage): full-attention layers keep every row,
        sliding-window layers window-1 (a lower bound where a window keeps `window` rows). None when
        the pool does not say its layout or types."""
        layout = getattr(self.pool, "layout", None)
        k, v = getattr(self.pool, "k_type", None), getattr(self.pool, "v_type", None)
        if not layout or not isinstance(k, str) or not isinstance(v, str):
            return None
        total = 0
        for s in layout:
            rows = tokens if s.sliding_window is None else min(tokens, max(1, s.sliding_window - 1))
            total += rows * s.num_kv_heads * (_row_bytes(k, s.head_dim) + _row_bytes(v, s.head_dim))
        return total

    def remove_document(self, info: dict) -> None:
        """Engine thread: forget a document; DocumentInUseError while requests use it."""
        users = self.engine.users_of(info["_handle"])
        if users > 0:
            raise DocumentInUseError(f"document {info['id']!r} is in use by {users} request(s)")
        self.pool.remove_document(info["_handle"])
        self.docs.pop(info["id"], None)
        self.save_store()

    def doc_info(self, handle, name_hint: str | None = None) -> dict:
        """Normalize the pool's view of one document to {id, name, tokens, bytes}."""
        row = None
        docs_fn = getattr(self.pool, "documents", None)
        if docs_fn is not None:
            for d in docs_fn():
                did = d.get("id") if isinstance(d, dict) else getattr(d, "id", None)
                if did == handle or did == getattr(handle, "id", object()) or str(did) == str(handle):
                    row = d
                    break
        src = row if row is not None else handle

        def get(*names, default=None):
            for n in names:
                if isinstance(src, dict) and n in src:
                    return src[n]
                if not isinstance(src, dict) and hasattr(src, n):
                    val = getattr(src, n)
                    return val() if callable(val) else val
            return default

        did = get("id", default=handle)
        return {
            "id": str(did),
            "name": get("name", default=None) or name_hint or str(did),
            "tokens": int(get("tokens", "length", "n_tokens", "doc_tokens", default=0) or 0),
            "bytes": int(get("bytes", "nbytes", "kv_bytes", default=0) or 0),
            "_handle": handle if not isinstance(handle, dict) else did,
        }

    def refresh_docs(self) -> None:
        """Engine thread: rebuild the mirror from pool.documents()."""
        docs: dict[str, dict] = {}
        for d in (self.pool.documents() if self.pool is not None and hasattr(self.pool, "documents") else []):
            did = d.get("id") if isinstance(d, dict) else getattr(d, "id", d)
            info = self.doc_info(did)
            old = self.docs.get(info["id"])
            if old is not None:
                info["_handle"] = old["_handle"]
            docs[info["id"]] = info
        self.docs = docs

    def public_doc(self, info: dict) -> dict:
        out = {k: v for k, v in info.items() if not k.startswith("_")}
        out["object"] = "document"
        out["agents"] = self.engine.users_of(info["_handle"])
        tier = self.tier_of(info["_handle"])
        if tier is not None:
            out["tier"] = tier
        return out

    def tier_of(self, handle) -> str | None:
        """The document's residency tier now ("gpu" | "host" | "evicted"; the pool moves documents
        between steps, so it is read live, not mirrored: one dict lookup, never waits for a step);
        None for pools without tiers."""
        docs = getattr(self.pool, "_docs", None)
        d = docs.get(handle) if isinstance(docs, dict) else None
        tier = getattr(d, "tier", None)
        return tier if isinstance(tier, str) else None

    def save_store(self) -> None:
        """Engine thread: persist the pool when a store directory is configured."""
        if self.store and hasattr(self.pool, "save"):
            self.pool.save(self.store)

    # --- memory -----------------------------------------------------------------------------
    def memory_sync(self) -> dict:
        rep = {}
        if self.pool is not None and hasattr(self.pool, "memory_report"):
            rep = dict(self.pool.memory_report())
        shared = _first(rep, "kv_bytes_shared", "shared_bytes", "bytes_shared", "total_bytes")
        naive = _first(rep, "kv_bytes_naive_f16", "naive_bytes", "kv_bytes_naive", "bytes_naive_f16")
        rep.setdefault("kv_bytes_shared", shared or 0)
        rep.setdefault("kv_bytes_naive_f16", naive or 0)
        self._agent_memory(rep)
        rep["ratio"] = round(rep["kv_bytes_naive_f16"] / rep["kv_bytes_shared"], 3) if rep["kv_bytes_shared"] else None
        return _jsonable(rep)

    def _agent_memory(self, rep: dict) -> None:
        """Naive bytes with the agents live now, *computed* (not measured): every agent would hold
        its own f16 copy of its document, so each document's measured f16 bytes are multiplied by its
        live agents (a document without agents counts once). `ratio_live` compares that with the
        measured shared prefixes + private suffixes. `computed` names the computed fields."""
        by_doc = self.engine.agents_by_document()
        docs = getattr(self.pool, "_docs", None)
        total, known = 0, False
        for info in self.docs.values():
            d = docs.get(info["_handle"]) if isinstance(docs, dict) else None
            per = getattr(d, "naive_f16_bytes", None) if d is not None else None
            if isinstance(per, int) and getattr(d, "resident", True):
                known = True
                total += per * max(1, by_doc.get(info["_handle"], 0))
        rep.setdefault("kv_bytes_agents", 0)
        rep["kv_bytes_naive_f16_agents"] = total if known else rep.get("kv_bytes_naive_f16", 0)
        used = rep.get("kv_bytes_shared", 0) + rep.get("kv_bytes_agents", 0)
        rep["ratio_live"] = round(rep["kv_bytes_naive_f16_agents"] / used, 3) if used else None
        rep["live_agents"] = self.engine.live_agents()
        rep["computed"] = {
            "kv_bytes_naive_f16_agents": "each resident document's measured f16 bytes x its live agents "
                                         "(once without agents)",
            "ratio_live": "kv_bytes_naive_f16_agents / (kv_bytes_shared + kv_bytes_agents)",
        }

    async def memory(self, max_age: float = 1.0, wait: float = 1.0) -> dict:
        """The pool's memory report, refreshed on the engine thread at most every `max_age` s.
        Waits at most `wait` s for a refresh (a long model step delays it); otherwise answers with
        the last report while the refresh completes in the background."""
        if time.monotonic() - self._mem_at > max_age:
            fut = self._mem_fut
            if fut is None or fut.done():
                fut = self._mem_fut = self.engine.call(self.memory_sync)

                def store(f):
                    if not f.cancelled() and f.exception() is None:
                        self._mem, self._mem_at = f.result(), time.monotonic()

                fut.add_done_callback(store)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait)
            except Exception as exc:  # slow step or engine stopped: keep the last report
                log.debug("memory report not ready: %s", exc)
        return self._mem

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self._tok_hist.append((now, self.engine.tokens_generated))
        self._tok_hist = [(t, n) for t, n in self._tok_hist if now - t <= 10.0]
        (t0, n0), (t1, n1) = self._tok_hist[0], self._tok_hist[-1]
        return round((n1 - n0) / (t1 - t0), 2) if t1 > t0 else 0.0

    async def status(self) -> dict:
        mem = await self.memory()
        eng = self.engine
        return {
            "model": self.model_name, "k": self.k, "v": self.v,
            "uptime_s": round(time.time() - self.started, 1),
            "engine_running": eng.running,
            "documents": [self.public_doc(d) for d in self.docs.values()],
            "live_agents": eng.live_agents(), "waiting": eng.waiting(),
            "agents": eng.live_requests()[:100],
            "memory": mem,
            "totals": {"requests_finished": eng.requests_finished, "tokens_generated": eng.tokens_generated,
                       "steps": eng.steps, "last_step_ms": round(eng.last_step_s * 1000, 2),
                       "tokens_per_s": self.tokens_per_s(), "step_failures": eng.step_failures,
                       "engine_restarts": eng.restarts},
        }


@functools.lru_cache(maxsize=None)
def _row_bytes(codec: str, head_dim: int) -> int:
    """Stored bytes of one KV row (one head) of `codec`: its storage for one row, measured."""
    from ..codecs import get_codec

    return get_codec(codec, head_dim).empty((1,)).nbytes()


def _first(d: dict, *keys):
    for k in keys:
        if isinstance(d.get(k), (int, float)):
            return d[k]
    return None


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if hasattr(x, "item"):
            return x.item()
        return str(x)
