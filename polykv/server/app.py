"""FastAPI application: documents, OpenAI-compatible completions over shared prefixes, metrics, status.

    app = create_app(pool)            # or create_app(engine)
    uvicorn.run(app, host="127.0.0.1", port=8000)

All model work runs on the engine thread (`polykv.engine.Engine`); tokenization runs on worker
threads; handlers only validate, submit and stream. Every bad input is a 4xx in OpenAI's error shape
(typed errors mapped in `errors.ERROR_TABLE`); anything else is a 500 with a request id and no
internal text. Errors of one request never touch another.

Layout: `state.py` (what the routes share), `routes/` (documents, completions, ops), `schemas.py`
(pydantic request bodies), `prompts.py` (tokenization), `errors.py`, `middleware.py` (request id,
API key, body limit), `metrics.py`.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from ..engine import Engine
from . import routes
from .errors import install_error_handlers
from .middleware import DEFAULT_MAX_BODY_BYTES, ApiKeyAuth, BodyLimit, RequestContext
from .state import ServerState

__all__ = ["ServerState", "create_app"]


def create_app(engine_or_pool, tok=None, *, model_name: str = "smollm2-135m", k: str | None = None,
               v: str | None = None, store: str | None = None, max_tokens_cap: int = 4096,
               context_length: int | None = None, engine_kwargs: dict | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """Build the HTTP app around an Engine (or a pool, for which an Engine is made).

    api_key: when set, every route but /health, the status page's HTML and the API description
        needs `Authorization: Bearer <api_key>` (401 otherwise).
    max_body_bytes: larger request bodies are refused with 413.
    The engine is started here and shut down (thread joined) when the app's lifespan ends.
    """
    if isinstance(engine_or_pool, Engine):
        engine = engine_or_pool
    else:
        engine = Engine(engine_or_pool, tok=tok, **(engine_kwargs or {}))
    k = k or getattr(engine.pool, "k", None) or getattr(engine.pool, "k_type", None)
    v = v or getattr(engine.pool, "v", None) or getattr(engine.pool, "v_type", None)
    state = ServerState(engine, model_name=model_name, k=k if isinstance(k, str) else None,
                        v=v if isinstance(v, str) else None, store=store, max_tokens_cap=max_tokens_cap,
                        context_length=context_length)
    prev_on_step = engine.on_step

    def on_step(dt: float, n: int) -> None:
        state.metrics.step_seconds.observe(dt)
        if prev_on_step is not None:
            prev_on_step(dt, n)

    engine.on_step = on_step
    engine.start()
    engine.call(state.refresh_docs).result(timeout=120)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="polykv", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions over shared, compressed document prefixes.")
    app.state.polykv = state
    install_error_handlers(app)
    for router in (routes.documents, routes.completions, routes.ops):
        app.include_router(router)
    # innermost first: body limit, API key, request id + last-resort 500, then metrics (outermost)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(RequestContext)
    state.metrics.install(app)
    return app
