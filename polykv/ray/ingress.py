"""`PolykvIngress`: the HTTP front of `polykv serve --ray` (a Ray Serve FastAPI ingress deployment).

It owns no model. Per request it decides where the work goes and forwards the HTTP request, as
Python values, to a `Replica` through a Serve `DeploymentHandle`; the replica runs it through the
very app `polykv serve` runs (`asgi.call_app`), so routes, validation, errors and SSE framing are
the same. What the ingress adds:

* Document affinity: a request naming a document is sent with `multiplexed_model_id=<document id>`
  (Ray Serve model multiplexing): to a replica holding it; when those are saturated
  (`max_ongoing_requests`), to the replica with the fewest documents, which loads it.
* The cluster's document registry: id, name, tokens, bytes and the published save (an object-store
  reference owned by this ingress, or `<store>/docs/<id>` on a shared filesystem), handed to the
  replica with every request for that document, so any replica can load it without a prefill.
  A document add goes to the replica with the fewest documents (a provisional multiplexed id that
  no replica holds); the text of a document already published is loaded there, not prefilled, and
  identical concurrent adds wait for the first.
* Retries: a replica that dies (or becomes unreachable) before its answer starts gets the request
  retried on another one (Serve's router drops the dead replica; the controller starts a new one).
  A stream that already sent events ends with an error event and `[DONE]`, never silence.
* `/health` lists the replicas (from the reports they send every second) and their documents;
  `DELETE /v1/documents/{id}` is refused (409) while requests through this ingress use the document;
  replicas drop a deleted document at their next report.

Without `--store`, the published saves live in the object store owned by this ingress: if the
ingress replica itself dies, its registry and objects go with it (documents are re-added, or use
`--store`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from ..server.errors import APIError, error_body, install_error_handlers, request_id
from ..server.middleware import DEFAULT_MAX_BODY_BYTES, ApiKeyAuth, BodyLimit, RequestContext
from .publish import published_documents
from .replica import REPORT_EVERY_S

__all__ = ["PolykvIngress", "RETRYABLE"]

log = logging.getLogger("polykv.ray")

_HOP = {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"host", b"authorization"}
REPORT_TTL_S = 5 * REPORT_EVERY_S  # a replica silent for longer is not listed


def _retryable() -> tuple[type[BaseException], ...]:
    """Errors that mean "this replica is gone", not "this request is bad"."""
    import ray.exceptions as rx
    from ray.serve.exceptions import ReplicaUnavailableError

    return (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError, rx.LocalRayletDiedError,
            ReplicaUnavailableError)


RETRYABLE = _retryable()


@serve.ingress()
class PolykvIngress:
    def __init__(self, replica, *, model_name: str = "smollm2-135m", k: str | None = None, v: str | None = None,
                 store: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, attempts: int = 8):
        self.replica = replica
        self.model_name, self.k, self.v = model_name, k, v
        self.store = store
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.attempts = int(attempts)
        self.started = time.time()
        self.registry: dict[str, dict] = {}
        self.deleted: set[str] = set()
        self.reports: dict[str, dict] = {}
        self.inflight: dict[str, int] = {}
        self.counts = {"requests": 0, "retries": 0, "replica_failures": 0, "stream_errors": 0, "unanswered": 0}
        self._adds: dict[str, asyncio.Future] = {}
        if store:
            for did, e in published_documents(store).items():
                self.registry[did] = {"id": did, "name": e["name"], "tokens": e["tokens"], "bytes": None,
                                      "source": e["path"], "by": None}

    # --- replica reports ----------------------------------------------------------------------
    async def report(self, info: dict) -> dict:
        """A replica's state (every REPORT_EVERY_S and after changes); the answer lists documents
        deleted in the cluster that it still holds."""
        info = dict(info, seen=time.monotonic())
        self.reports[info["replica"]] = info
        held = {d["id"] for d in info["documents"]}
        for d in info["documents"]:
            e = self.registry.get(d["id"])
            if e is not None and not e.get("bytes"):
                e["bytes"] = d.get("bytes")
        return {"drop": sorted(held & self.deleted)}

    def live_replicas(self) -> list[dict]:
        now = time.monotonic()
        return [r for r in self.reports.values() if now - r["seen"] <= REPORT_TTL_S]

    def holders(self, doc_id: str) -> list[str]:
        return sorted(r["replica"] for r in self.live_replicas()
                      if any(d["id"] == doc_id and d.get("tier", "gpu") != "evicted" for d in r["documents"]))

    def public_doc(self, e: dict) -> dict:
        return {"id": e["id"], "name": e["name"] or e["id"], "tokens": e["tokens"], "bytes": int(e["bytes"] or 0),
                "agents": self.inflight.get(e["id"], 0), "object": "document", "replicas": self.holders(e["id"])}

    # --- forwarding ---------------------------------------------------------------------------
    async def _call(self, method: str, req: dict, route_key: str | None, stream: bool):
        """Start `method` on a replica, retrying on another while replicas die. Returns (generator
        or None, first item)."""
        last = None
        for attempt in range(self.attempts):
            opts = {"stream": stream}
            if route_key:
                opts["multiplexed_model_id"] = route_key
            h = self.replica.options(**opts)
            try:
                if stream:
                    gen = getattr(h, method).remote(req)
                    return gen, await gen.__anext__()
                return None, await getattr(h, method).remote(req)
            except RETRYABLE as exc:
                last = exc
                self.counts["replica_failures"] += 1
                self.counts["retries"] += 1
                log.warning("replica failed before answering (%s: %s); retry %d", type(exc).__name__, exc, attempt + 1)
                await asyncio.sleep(min(2.0, 0.05 * 2 ** attempt))
        self.counts["unanswered"] += 1
        raise APIError(503, f"no replica could answer after {self.attempts} attempts: {type(last).__name__}",
                       code="replica_unavailable", headers={"Retry-After": "2"})

    def _req(self, request, body: bytes, **extra) -> dict:
        headers = [(k, v) for k, v in request.scope.get("headers") or [] if k.lower() not in _HOP]
        rid = request_id(request)
        if rid:
            headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"] + [(b"x-request-id", rid.encode())]
        return {"method": request.method, "path": request.url.path, "query": request.scope.get("query_string", b""),
                "headers": headers, "body": body, **extra}

    async def forward(self, request, doc_aware: bool = False):
        body = await request.body()
        doc = source = None
        if doc_aware:
            try:
                obj = json.loads(body)
                named = obj.get("document") if isinstance(obj, dict) else None
            except ValueError:
                named = None
            if isinstance(named, str) and named in self.deleted and named not in self.registry:
                raise APIError(404, f"Unknown document {named!r}", param="document", code="document_not_found")
            if isinstance(named, str) and named in self.registry:
                doc, source = named, self.registry[named]["source"]
        # a document the registry does not know goes to any replica: its app answers (404) as `polykv serve` does
        req = self._req(request, body, document=doc, source=source)
        self.counts["requests"] += 1
        if doc:
            self.inflight[doc] = self.inflight.get(doc, 0) + 1
        released = False

        def release():
            nonlocal released
            if doc and not released:
                released = True
                self.inflight[doc] -= 1

        try:
            gen, first = await self._call("handle", req, doc, stream=True)
        except BaseException:
            release()
            raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in first["headers"] if k.lower() not in _HOP}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        if not sse:  # a JSON (or HTML) answer: one item, complete
            try:
                rest = [c async for c in gen]
            except RETRYABLE:
                rest = []  # the answer was complete in its first item
            finally:
                release()
            return Response(first["body"] + b"".join(rest), status_code=first["status"], headers=headers)

        async def events():
            done = False
            try:
                yield first["body"]
                async for chunk in gen:
                    yield chunk
                done = True
            except RETRYABLE as exc:
                self.counts["replica_failures"] += 1
                self.counts["stream_errors"] += 1
                err = error_body(f"the replica serving this stream failed ({type(exc).__name__}); the tokens "
                                 f"sent so far stand, the rest was not generated", "server_error",
                                 code="replica_failed")
                yield ("data: " + json.dumps(err) + "\n\ndata: [DONE]\n\n").encode()
                done = True
            finally:
                release()
                if not done:
                    gen.cancel()  # the client went away: the replica's app sees the disconnect

        return StreamingResponse(events(), status_code=first["status"], headers=headers)

    async def add_document(self, request):
        body = await request.body()
        key = hashlib.sha256(body).hexdigest()
        pending = self._adds.get(key)
        if pending is not None:  # the same body is being added: one prefill, both get its answer
            out = await asyncio.shield(pending)
        else:
            fut = self._adds[key] = asyncio.get_running_loop().create_future()
            try:
                known = {did: e["source"] for did, e in self.registry.items() if e["source"] is not None}
                req = self._req(request, body, known=known)
                self.counts["requests"] += 1
                # a multiplexed id no replica holds: Serve picks a replica with the fewest documents
                _, out = await self._call("add_document", req, "add-" + key[:16], stream=False)
                self._register(out)
                fut.set_result(out)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
                raise
            finally:
                self._adds.pop(key, None)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in out["headers"] if k.lower() not in _HOP}
        return Response(out["body"], status_code=out["status"], headers=headers)

    def _register(self, out: dict) -> None:
        import ray

        if out["status"] != 200:
            return
        info = json.loads(out["body"])
        did = info["id"]
        self.deleted.discard(did)
        e = self.registry.get(did)
        src = out.get("source")
        if e is None or src is not None:
            source = src if isinstance(src, str) or src is None else [ray.put(src)]
            self.registry[did] = e = {"id": did, "name": info.get("name"), "tokens": info.get("tokens", 0),
                                      "bytes": info.get("bytes"), "source": source, "by": out.get("replica")}
        elif info.get("name") and not e.get("name"):
            e["name"] = info["name"]

    def delete_document(self, doc_id: str) -> dict:
        e = self.registry.get(doc_id)
        if e is None:
            raise APIError(404, f"Unknown document {doc_id!r}", param="doc_id", code="document_not_found")
        users = self.inflight.get(doc_id, 0)
        if users:
            raise APIError(409, f"document {doc_id!r} is in use by {users} request(s)", param="doc_id",
                           code="document_in_use")
        del self.registry[doc_id]
        self.deleted.add(doc_id)
        if isinstance(e["source"], str) and self.store:
            shutil.rmtree(e["source"], ignore_errors=True)
        return {"id": doc_id, "object": "document", "deleted": True}

    # --- cluster views ------------------------------------------------------------------------
    def health(self) -> tuple[dict, int]:
        live = self.live_replicas()
        reps = [{"replica": r["replica"], "actor": r["actor"], "node": r["node"], "pid": r["pid"],
                 "documents": [d["id"] for d in r["documents"] if d.get("tier", "gpu") != "evicted"],
                 "prefills": r["prefills"], "loads": r["loads"], "requests": r["requests"],
                 "live_agents": r["live_agents"], "waiting": r["waiting"], "torch_threads": r["torch_threads"],
                 "engine_running": r["engine_running"], "uptime_s": r["uptime_s"]}
                for r in sorted(live, key=lambda r: r["replica"])]
        ok = bool(live)
        body = {"status": "ok" if ok else "starting", "model": self.model_name, "replicas": reps,
                "documents": len(self.registry), "live_agents": sum(r["live_agents"] for r in live),
                "prefills": sum(r["prefills"] for r in live), "loads": sum(r["loads"] for r in live),
                **{k: v for k, v in self.counts.items()}}
        return body, 200 if ok else 503

    def status(self) -> dict:
        live = self.live_replicas()
        return {"model": self.model_name, "k": self.k, "v": self.v, "uptime_s": round(time.time() - self.started, 1),
                "engine_running": bool(live), "documents": [self.public_doc(e) for e in self.registry.values()],
                "live_agents": sum(r["live_agents"] for r in live), "waiting": sum(r["waiting"] for r in live),
                "agents": [], "memory": {},
                "totals": {"requests_finished": sum(r["requests_finished"] for r in live),
                           "tokens_generated": sum(r["tokens_generated"] for r in live),
                           "steps": None, "last_step_ms": None, "tokens_per_s": None},
                "replicas": self.health()[0]["replicas"], "ingress": dict(self.counts)}

    def metrics_text(self) -> str:
        lines = []

        def metric(name: str, help_: str, kind: str, rows: list[tuple[str, float]]):
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in rows)

        for key, help_ in (("requests", "requests forwarded to replicas"),
                           ("retries", "requests retried on another replica after a replica failure"),
                           ("replica_failures", "replica failures seen by requests"),
                           ("stream_errors", "streams ended with an error event by a replica failure"),
                           ("unanswered", "requests no replica could answer (503)")):
            metric(f"polykv_ray_{key}_total", help_, "counter", [("", self.counts[key])])
        live = self.live_replicas()
        metric("polykv_ray_replicas", "replicas reporting", "gauge", [("", len(live))])
        metric("polykv_ray_documents", "documents in the cluster registry", "gauge", [("", len(self.registry))])
        for key, help_ in (("prefills", "document prefills run by the replica"),
                           ("loads", "published documents loaded by the replica (no prefill)"),
                           ("live_agents", "agents decoding on the replica")):
            metric(f"polykv_ray_replica_{key}", help_, "gauge",
                   [(f'{{replica="{r["replica"]}"}}', r[key]) for r in live])
        return "\n".join(lines) + "\n"

    # --- the ASGI app (built in the replica, after __init__) ------------------------------------
    def __serve_build_asgi_app__(self):
        app = FastAPI(title="polykv (Ray Serve)", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None)
        install_error_handlers(app)

        @app.post("/v1/documents")
        async def add_document(request: Request):
            return await self.add_document(request)

        @app.get("/v1/documents")
        async def list_documents():
            return {"object": "list", "data": [self.public_doc(e) for e in self.registry.values()]}

        @app.get("/v1/documents/{doc_id}")
        async def get_document(doc_id: str):
            e = self.registry.get(doc_id)
            if e is None:
                raise APIError(404, f"Unknown document {doc_id!r}", param="doc_id", code="document_not_found")
            return self.public_doc(e)

        @app.delete("/v1/documents/{doc_id}")
        async def delete_document(doc_id: str):
            return self.delete_document(doc_id)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.forward(request, doc_aware=True)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.forward(request, doc_aware=True)

        @app.get("/health")
        async def health():
            body, code = self.health()
            return JSONResponse(body, status_code=code)

        @app.get("/v1/status")
        async def status():
            return self.status()

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics_text(), media_type="text/plain; version=0.0.4")

        # everything else (/, /v1/models, /openapi.json, /docs, unknown URLs) as the replica's app answers it
        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                       include_in_schema=False)
        async def passthrough(request: Request, path: str):
            return await self.forward(request)

        app.add_middleware(BodyLimit, max_bytes=self.max_body_bytes)
        if self.api_key:
            app.add_middleware(ApiKeyAuth, api_key=self.api_key)
        app.add_middleware(RequestContext)
        return app
