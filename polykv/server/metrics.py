"""Prometheus metrics of one app (own CollectorRegistry, so several apps can live in one process)."""

from __future__ import annotations

import time

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, state):
        self.state = state
        r = self.registry = CollectorRegistry()
        self.requests = Counter("polykv_requests", "HTTP requests by route and status code",
                                ["method", "route", "status"], registry=r)
        self.request_seconds = Histogram("polykv_request_duration_seconds", "HTTP request latency",
                                         ["route"], registry=r,
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.prompt_tokens = Counter("polykv_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.completion_tokens = Counter("polykv_completion_tokens", "Completion tokens returned", registry=r)
        self.step_seconds = Histogram("polykv_step_seconds", "Engine step latency (one AgentBatch step)",
                                      registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        eng = state.engine
        Gauge("polykv_live_agents", "Agents currently decoding", registry=r).set_function(eng.live_agents)
        Gauge("polykv_waiting_requests", "Requests queued for admission", registry=r).set_function(eng.waiting)
        Gauge("polykv_documents", "Shared documents held", registry=r).set_function(lambda: len(state.docs))
        Gauge("polykv_document_prefills", "Document prefills run by the pool since start (adds, re-prefills of "
              "evicted documents; documents loaded from a save or a peer cost none)",
              registry=r).set_function(lambda: state.prefills)
        Gauge("polykv_generated_tokens", "Tokens sampled by the engine since start",
              registry=r).set_function(lambda: eng.tokens_generated)
        self.kv_bytes = Gauge("polykv_kv_bytes", "KV cache bytes, measured (storage bytes): shared = compressed "
                              "document prefixes (one copy each), agents = private suffixes of live agents, "
                              "naive = one real f16 cache per document, measured at prefill", ["kind"], registry=r)
        self.kv_bytes_computed = Gauge("polykv_kv_bytes_computed", "KV cache bytes, computed (not measured): "
                                       "naive_agents = each document's measured f16 bytes x its live agents",
                                       ["kind"], registry=r)
        Gauge("polykv_engine_step_failures", "Batch steps that raised (each followed by isolating the failing "
              "agent)", registry=r).set_function(lambda: eng.step_failures)
        Gauge("polykv_engine_restarts", "Engine loop iterations that failed and were restarted",
              registry=r).set_function(lambda: eng.restarts)

    def install(self, app) -> None:
        owner = self

        class _CountRequests:
            """Pure ASGI middleware (BaseHTTPMiddleware would break request.is_disconnected())."""

            def __init__(self, inner):
                self.inner = inner

            async def __call__(self, scope, receive, send):
                if scope["type"] != "http":
                    return await self.inner(scope, receive, send)
                t0 = time.perf_counter()
                status = {"code": 500}

                async def send_wrapper(message):
                    if message["type"] == "http.response.start":
                        status["code"] = message["status"]
                    await send(message)

                try:
                    await self.inner(scope, receive, send_wrapper)
                finally:
                    route = scope.get("route")
                    path = getattr(route, "path", None) or "unmatched"
                    method = scope.get("method", "GET") if route is not None else "other"
                    owner.requests.labels(method, path, str(status["code"])).inc()
                    owner.request_seconds.labels(path).observe(time.perf_counter() - t0)

        app.add_middleware(_CountRequests)

        @app.get("/metrics", tags=["ops"], response_class=Response)
        async def metrics():
            mem = await self.state.memory()
            self.kv_bytes.labels("shared").set(mem.get("kv_bytes_shared") or 0)
            self.kv_bytes.labels("naive").set(mem.get("kv_bytes_naive_f16") or 0)
            self.kv_bytes.labels("agents").set(mem.get("kv_bytes_agents") or 0)
            self.kv_bytes_computed.labels("naive_agents").set(mem.get("kv_bytes_naive_f16_agents") or 0)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
