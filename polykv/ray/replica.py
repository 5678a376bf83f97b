"""`Replica`: one polykv engine as a Ray Serve deployment replica.

Each replica is a Ray actor holding the model, a `SharedKVPool` and the `polykv.server` app
(`create_app`: the same routes, validation and errors as `polykv serve`). The ingress forwards HTTP
requests as Python values (`asgi.call_app`); nothing here re-implements an endpoint.

Documents (Ray Serve model multiplexing, keyed by document id):
* `get_document(doc_id)` is the replica's `@serve.multiplexed` loader: Serve records which replica
  holds which document ids and routes a request carrying `multiplexed_model_id=doc_id` to one of
  them; when those are saturated (`max_ongoing_requests`), to the replica with the fewest documents,
  which then loads the document here.
* Loading = `publish.import_document` of the document's published save (object store or shared
  store), with `SharedKVPool.load`'s checks: no prefill. Only a document nobody has published yet
  is prefilled (`add_document`), then published (`publish.export_document`) for the others.
* The pool's own budget decides what stays resident; Serve's list is a routing hint. A request
  always passes through `_ensure`, which re-loads (never re-prefills) a document the pool evicted.

Every response carries `X-Polykv-Replica: <replica id>`. Every second (and after every change) the
replica reports its documents, prefills and loads to the ingress (`/health`), whose answer lists
documents deleted in the cluster; the replica drops those once no request uses them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from ray import serve

from .asgi import call_app
from .publish import document_id, export_document, import_document

__all__ = ["REPLICA_HEADER", "Replica"]

log = logging.getLogger("polykv.ray")

REPLICA_HEADER = "x-polykv-replica"
MAX_DOCS_PER_REPLICA = 1024  # routing hint entries; the pool's budget bounds the memory
REPORT_EVERY_S = 1.0


class Replica:
    async def __init__(self, *, model: str | None = None, model_name: str = "smollm2-135m", k: str = "q8_0",
                       v: str = "turbo3", preset: str | None = None, innerq=None, budget_bytes: int | None = None,
                       host_budget_bytes: int | None = None, torch_threads: int | None = None,
                       store: str | None = None, max_agents: int = 64, ingress: str = "PolykvIngress",
                       app_name: str = "polykv"):
        for key, val in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
            os.environ.setdefault(key, val)
        import ray
        import torch

        from ..hf.loading import load_model
        from ..server import build_pool, create_app

        if torch_threads:  # one replica per core: its threads must not fight the other replicas'
            torch.set_num_threads(int(torch_threads))
        m, tok = load_model(model)
        pool = build_pool(m, tok, k=k, v=v, budget_bytes=budget_bytes, innerq=innerq,
                          host_budget_bytes=host_budget_bytes, preset=preset)
        self.app = create_app(pool, model_name=model_name, k=k, v=v,
                              engine_kwargs={"num_threads": torch_threads, "max_agents": max_agents})
        self.state = self.app.state.polykv
        self.pool = pool
        self.store = store
        rt = ray.get_runtime_context()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.actor_name = rt.get_actor_name()
        self.node_id = rt.get_node_id()
        self.started = time.time()
        self.loads = 0  # documents loaded from a peer's published save (no prefill)
        self.requests = 0
        self._sources: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._header = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        self._ingress = serve.get_deployment_handle(ingress, app_name=app_name)
        self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    # --- documents ----------------------------------------------------------------------------
    def _holds(self, doc_id: str) -> bool:
        d = self.pool._docs.get(doc_id) if isinstance(getattr(self.pool, "_docs", None), dict) else None
        return d is not None and d.resident and doc_id in self.state.docs

    @serve.multiplexed(max_num_models_per_replica=MAX_DOCS_PER_REPLICA)
    async def get_document(self, doc_id: str) -> str:
        """Serve's multiplexed loader: make `doc_id` resident here (from its published save)."""
        await self._ensure(doc_id, self._sources.get(doc_id))
        return doc_id

    async def _ensure(self, doc_id: str, source) -> None:
        """Load published `doc_id` unless this replica holds it resident (never prefills)."""
        if source is None or self._holds(doc_id):
            return
        lock = self._locks.setdefault(doc_id, asyncio.Lock())
        async with lock:
            if self._holds(doc_id):
                return
            files = await source[0] if isinstance(source, list) else source  # [ObjectRef] or a store path
            await self.state.on_engine(self._adopt, files)
            self.loads += 1
        self._report_soon()

    def _adopt(self, files) -> None:
        """Engine thread: import a published document and mirror it in the app's state; refused
        (and rolled back) when the KV budget cannot hold it (BudgetExceededError -> 429)."""
        from ..errors import BudgetExceededError

        state = self.state
        for did in import_document(self.pool, files):
            info = state.doc_info(did)
            state.docs[info["id"]] = info
            try:
                state.engine.check_budget(f"document {did!r}")
            except BudgetExceededError:
                if not state.engine.users_of(did):
                    self.pool.remove_document(did)
                    state.docs.pop(did, None)
                raise

    def _drop(self, doc_ids: list[str]) -> None:
        """Engine thread: forget documents deleted in the cluster; those in use stay until a later report."""
        from ..errors import DocumentInUseError

        for did in doc_ids:
            info = self.state.docs.get(did)
            if info is None:
                continue
            try:
                self.state.remove_document(info)
            except DocumentInUseError:
                pass

    # --- requests -----------------------------------------------------------------------------
    async def handle(self, req: dict):
        """Stream one HTTP request through the app (asgi.call_app's items). `req["document"]`,
        `req["source"]`: the document the request names and its published save ([ObjectRef] or a
        path), when the cluster knows it."""
        self.requests += 1
        doc, source = req.get("document"), req.get("source")
        if doc is not None and source is not None:
            self._sources[doc] = source
            try:
                await self.get_document(doc)
                await self._ensure(doc, source)
            except Exception as exc:  # a budget refusal or a save this replica cannot load
                yield _error_response(exc, self._header)
                return
        async for part in call_app(self.app, req, self._header):
            yield part

    async def add_document(self, req: dict) -> dict:
        """POST /v1/documents through the app. `req["known"]`: {doc id: source} of the documents the
        cluster has published; a text whose id is among them is loaded, not prefilled. A new
        document is published: the answer's "source" is its save (files dict, or the store path)."""
        self.requests += 1
        known = req.get("known") or {}
        try:
            text = json.loads(req.get("body") or b"").get("text")
        except (ValueError, AttributeError):
            text = None
        if isinstance(text, str) and text:
            try:
                did = await asyncio.to_thread(document_id, self.pool, text)
            except Exception:  # the app answers the same text with its own error
                did = None
            if did in known:
                try:
                    await self._ensure(did, known[did])
                except Exception as exc:
                    return _collected(_error_response(exc, self._header), self.replica_id)
        parts = [p async for p in call_app(self.app, req, self._header)]
        out = _collected(parts[0], self.replica_id, parts[1:])
        if out["status"] == 200:
            did = json.loads(out["body"])["id"]
            if did not in known:
                out["source"] = await self.state.on_engine(export_document, self.pool, did, self.store)
            await self.get_document(did)  # routing: Serve now knows this replica holds it
            self._report_soon()
        return out

    # --- reports ------------------------------------------------------------------------------
    def info(self) -> dict:
        import torch

        eng = self.state.engine
        return {"replica": self.replica_id, "actor": self.actor_name, "node": self.node_id, "pid": os.getpid(),
                "documents": [self.state.public_doc(d) for d in list(self.state.docs.values())],
                "prefills": self.state.prefills, "loads": self.loads, "requests": self.requests,
                "live_agents": eng.live_agents(), "waiting": eng.waiting(),
                "requests_finished": eng.requests_finished, "tokens_generated": eng.tokens_generated,
                "torch_threads": torch.get_num_threads(), "engine_running": eng.running,
                "uptime_s": round(time.time() - self.started, 1), "at": time.time()}

    async def _report(self) -> None:
        try:
            reply = await self._ingress.report.remote(self.info())
        except Exception as exc:  # the ingress is starting or being replaced: the next report retries
            log.debug("report to the ingress failed: %s", exc)
            return
        drop = [d for d in (reply or {}).get("drop", []) if d in self.state.docs]
        if drop:
            await self.state.on_engine(self._drop, drop)

    def _report_soon(self) -> None:
        asyncio.get_running_loop().create_task(self._report())

    async def _report_loop(self) -> None:
        while True:
            await self._report()
            await asyncio.sleep(REPORT_EVERY_S)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped is replaced."""
        if not self.state.engine.running:
            raise RuntimeError("polykv engine is not running")

    def __del__(self):
        eng = getattr(getattr(self, "state", None), "engine", None)
        if eng is not None:
            eng.shutdown(timeout=5)


def _error_response(exc: BaseException, extra: list) -> dict:
    """The app's error answer for an exception raised outside it (typed -> its status, else 500)."""
    from ..server.errors import to_api_error

    err = to_api_error(exc, None, param="document")
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json")] + list(extra)
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    return {"status": err.status, "headers": headers, "body": body}


def _collected(start: dict, replica_id: str, rest: list = ()) -> dict:
    return {"status": start["status"], "headers": start["headers"], "body": start["body"] + b"".join(rest),
            "replica": replica_id}
