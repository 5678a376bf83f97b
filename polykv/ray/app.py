"""Build and run the Ray Serve application of `polykv serve --ray`.

    from polykv.ray import build_app, serve_ray
    app = build_app(replicas=2, cpus_per_replica=1)         # a Serve Application (ingress + replicas)
    serve.run(app, name="polykv", route_prefix="/")         # on a running Ray (ray.init / ray start)
    serve_ray(replicas=2, port=8000)                        # what the CLI runs: init, start, run, block

Shape: one `PolykvIngress` replica (FastAPI, no model, 0 CPUs) in front of `replicas` `Replica`
replicas (each a Ray actor with `cpus_per_replica` CPUs and as many torch threads, the model, a pool
and an engine). Ray places the replicas on the cluster's nodes; Serve's HTTP proxy (on every node)
takes the requests.
"""

from __future__ import annotations

import logging
import os
import signal
import time

__all__ = ["APP_NAME", "INGRESS_NAME", "REPLICA_NAME", "build_app", "serve_ray", "start_serve"]

log = logging.getLogger("polykv.ray")

APP_NAME = "polykv"
INGRESS_NAME = "PolykvIngress"
REPLICA_NAME = "PolykvReplica"


def build_app(*, replicas: int = 2, cpus_per_replica: float = 1, torch_threads: int | None = None,
              model: str | None = None, k: str | None = None, v: str | None = None, preset: str | None = None,
              store: str | None = None, budget_bytes: int | None = None, host_budget_bytes: int | None = None,
              api_key: str | None = None, max_body_bytes: int | None = None, max_ongoing_requests: int = 32,
              max_agents: int = 64, app_name: str = APP_NAME, health_check_period_s: float = 2.0,
              health_check_timeout_s: float = 30.0):
    """The Serve application (bind it with `serve.run(app, name=app_name)`; `app_name` must match).

    replicas / cpus_per_replica: engine replicas and the CPUs Ray reserves for each.
    torch_threads: intra-op threads per replica (default: cpus_per_replica, at least 1), so replicas
        sharing a node do not fight over its cores.
    max_ongoing_requests: requests one replica runs at once (its agents); a document's requests
        spill to a second replica (which loads its published save) once its holders are that busy.
    store: a directory every node sees (shared filesystem): documents are published to
        `<store>/docs/<id>/` instead of the object store, and survive a restart of the application.
    """
    from ray import serve

    from ..presets import resolve
    from .ingress import PolykvIngress
    from .replica import Replica

    named = preset if (k is None and v is None) else None  # as `polykv serve`: calibrated types by name
    k, v, innerq = resolve(preset, k, v)
    threads = int(torch_threads) if torch_threads else max(1, int(cpus_per_replica))
    name = str(model or "smollm2-135m")
    if store is not None:
        os.makedirs(store, exist_ok=True)
        store = os.path.abspath(store)
    replica = serve.deployment(
        Replica, name=REPLICA_NAME, num_replicas=int(replicas), max_ongoing_requests=int(max_ongoing_requests),
        ray_actor_options={"num_cpus": cpus_per_replica}, health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s, graceful_shutdown_timeout_s=5,
    ).bind(model=model, model_name=name, k=k, v=v, preset=named, innerq=innerq, budget_bytes=budget_bytes,
           host_budget_bytes=host_budget_bytes, torch_threads=threads, store=store, max_agents=max_agents,
           ingress=INGRESS_NAME, app_name=app_name)
    kw = {"max_body_bytes": max_body_bytes} if max_body_bytes is not None else {}
    return serve.deployment(
        PolykvIngress, name=INGRESS_NAME, num_replicas=1, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0},
    ).bind(replica, model_name=name, k=k, v=v, store=store, api_key=api_key, **kw)


# Serve's controller kills an HTTP proxy not ready within this many seconds (Ray's default 5; x the
# proxy's restarts): a Ray worker takes longer to start on a loaded machine. Set before `ray.init`
# starts a local Ray (its processes inherit the environment); a cluster's own setting is kept.
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_S = "60"


def start_serve(http_options: dict, attempts: int = 3, note=None) -> None:
    """`serve.start(http_options=...)`, again (after a `serve.shutdown`) when its HTTP proxy actor
    died before it ever ran: on a loaded machine Serve's controller can kill a proxy that is slow to
    start, and `serve.start` then raises ActorDiedError (seen in CI on a busy 2-core machine).
    `note`: where the retry is told (default: this module's log, as a warning)."""
    import ray
    from ray import serve

    for attempt in range(1, attempts + 1):
        try:
            serve.start(http_options=http_options)
            return
        except ray.exceptions.ActorDiedError as exc:
            if attempt == attempts:
                raise
            (note or log.warning)(f"serve.start: its proxy died before it started ({type(exc).__name__}); "
                                  f"starting Serve again ({attempt + 1}/{attempts})")
            serve.shutdown()


def serve_ray(host: str = "127.0.0.1", port: int = 8000, *, replicas: int = 2, address: str | None = None,
              cpus_per_replica: float = 1, log_level: str = "info", api_key: str | None = None, **app_kw) -> None:
    """`polykv serve --ray`: join the Ray cluster at `address` (None: $RAY_ADDRESS, else a new local
    one), start Serve's HTTP proxy on host:port, deploy `build_app(...)` and block until Ctrl-C /
    SIGTERM, then delete the application (replicas stop, engines shut down)."""
    import ray
    from ray import serve

    from ..server.runner import check_bind

    api_key = api_key or os.environ.get("POLYKV_API_KEY") or None
    check_bind(host, api_key)
    address = address or os.environ.get("RAY_ADDRESS") or None
    os.environ.setdefault(PROXY_READY_ENV, PROXY_READY_S)
    ray.init(address=address, include_dashboard=False, logging_level=log_level.upper())
    start_serve({"host": host, "port": int(port)})
    app = build_app(replicas=replicas, cpus_per_replica=cpus_per_replica, api_key=api_key, **app_kw)
    serve.run(app, name=APP_NAME, route_prefix="/")
    log.warning("polykv serve --ray: %d replica(s) on http://%s:%d (Ctrl-C stops)", replicas, host, port)

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        ray.shutdown()
