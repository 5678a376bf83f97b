"""Run the app: `serve(...)` (blocking, for the CLI) and `ServerThread` (in-process uvicorn on a
free loopback port, for tests and the benchmark)."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

__all__ = ["ServerThread", "build_pool", "check_bind", "free_port", "serve"]

log = logging.getLogger("polykv.server")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _store_has_pool(store: str | os.PathLike) -> bool:
    """A complete saved pool (the pool's own test: stray temp files of an interrupted save do not count)."""
    from ..pool.persist import has_saved_pool

    return Path(store).is_dir() and has_saved_pool(store)


def build_pool(model, tok, *, k: str = "q8_0", v: str = "turbo3", store=None, budget_bytes=None, device=None,
               innerq=None, host_budget_bytes=None, preset: str | None = None):
    """SharedKVPool (loaded from `store` when it holds a saved pool); DensePool if the shared pool is
    not importable. budget_bytes: the GPU-tier budget (`gpu_budget_bytes`); host_budget_bytes: the
    host tier's (None: no host tier). preset: the pool takes the preset's per-layer types from the
    model's calibrated precision table when one exists (k / v are then the preset's pair)."""
    try:
        from ..pool import SharedKVPool
    except ImportError as exc:  # pragma: no cover - only while the pool package is incomplete
        log.warning("polykv.pool.SharedKVPool unavailable (%s); serving with the dense reference pool", exc)
        from ..engine.dense import DensePool

        return DensePool(model, tok, k=k, v=v, device=device, budget_bytes=budget_bytes)
    if store is not None and _store_has_pool(store):
        return SharedKVPool.load(str(store), model, tok, gpu_budget_bytes=budget_bytes,
                                 host_budget_bytes=host_budget_bytes)
    types = dict(preset=preset) if preset is not None else dict(k=k, v=v)
    return SharedKVPool(model, tok, device=device, budget_bytes=budget_bytes, innerq=innerq,
                        host_budget_bytes=host_budget_bytes, **types)


def _make_app(model=None, k="q8_0", v="turbo3", store=None, budget_bytes=None, innerq=None,
              host_budget_bytes=None, preset=None, device=None, dtype="auto", **app_kw):
    from ..hf.loading import load_model, model_device, model_dtype
    from .app import create_app

    name = model or "smollm2-135m"
    dev = model_device(device)
    m, tok = load_model(model, device=dev, dtype=model_dtype(dtype, dev))
    log.info("polykv serve: %s on %s (%s)", name, dev, str(next(m.parameters()).dtype).removeprefix("torch."))
    if store is not None:
        Path(store).mkdir(parents=True, exist_ok=True)
    pool = build_pool(m, tok, k=k, v=v, store=store, budget_bytes=budget_bytes, innerq=innerq,
                      host_budget_bytes=host_budget_bytes, preset=preset)
    return create_app(pool, model_name=str(name), k=k, v=v, store=str(store) if store else None, **app_kw)


class _Stderr(logging.StreamHandler):
    """Writes each record to sys.stderr as it is then (not as it was when the handler was made)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _log_to_stderr(level: str) -> None:
    """polykv's own log lines (which model on which device, warnings) beside uvicorn's, in its format:
    uvicorn configures only its own loggers."""
    root = logging.getLogger("polykv")
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.DEBUG))  # uvicorn's "trace": DEBUG


def check_bind(host: str, api_key: str | None) -> bool:
    """Warn (log) when `host` is reachable from other machines and no API key is set. True if it warned."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost
        loopback = False
    if loopback or api_key:
        return False
    log.warning("polykv serve: binding %s without an API key: anyone who can reach this port can read every "
                "document and run the model. Set --api-key or POLYKV_API_KEY, or bind 127.0.0.1.", host)
    return True


def serve(host: str = "127.0.0.1", port: int = 8000, model: str | None = None, k: str | None = None,
          v: str | None = None, store: str | None = None, budget_bytes: int | None = None,
          log_level: str = "info", torch_threads: int | None = None, api_key: str | None = None,
          max_body_bytes: int | None = None, preset: str | None = None,
          host_budget_bytes: int | None = None, device: str | None = None, dtype: str = "auto") -> None:
    """Load the model, build (or load from `store`) the pool and serve until interrupted.

    `preset` (polykv.presets; default "default") gives K/V types and InnerQ; `k` / `v` override it.
    `budget_bytes`: the pool's GPU-tier budget; `host_budget_bytes`: its host tier (None: none).
    `torch_threads`: intra-op threads of the engine (None: torch's default).
    `device`: where the model and the pool live (None / "auto": cuda when a GPU is there, else cpu);
    `dtype`: the weights' ("auto": bfloat16 on CUDA, float32 on the CPU; `polykv.hf.loading.model_dtype`).
    `api_key`: Bearer key for every route but /health (None: $POLYKV_API_KEY, else open; binding a
    non-loopback host without one logs a warning). `max_body_bytes`: larger bodies get 413.
    Ctrl-C / SIGTERM: uvicorn stops accepting, the app's lifespan ends and the engine thread is
    joined before this returns.
    """
    import uvicorn

    _log_to_stderr(log_level)
    api_key = api_key or os.environ.get("POLYKV_API_KEY") or None
    check_bind(host, api_key)
    app_kw = {"api_key": api_key}
    if max_body_bytes is not None:
        app_kw["max_body_bytes"] = max_body_bytes
    from ..presets import resolve

    named = preset if (k is None and v is None) else None  # explicit --k / --v: fixed types
    k, v, innerq = resolve(preset, k, v)
    app = _make_app(model=model, k=k, v=v, store=store, budget_bytes=budget_bytes, innerq=innerq,
                    host_budget_bytes=host_budget_bytes, preset=named, device=device, dtype=dtype,
                    engine_kwargs={"num_threads": torch_threads}, **app_kw)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ServerThread:
    """uvicorn serving `app` in a background thread on 127.0.0.1:<free port>.

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")
    Exiting stops uvicorn (graceful, then forced) and joins the thread; the app's lifespan shuts the
    engine down.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self.port = port or free_port(host)
        self.config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, lifespan="on",
                                     timeout_graceful_shutdown=3, access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn thread died during startup")
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
