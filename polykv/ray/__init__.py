"""Scale-out on Ray Serve: `polykv serve --ray --replicas N`.

    from polykv.ray import build_app, serve_ray

* `app.py` — `build_app` (the Serve application: one `PolykvIngress`, N `Replica`s) and `serve_ray`
  (what the CLI runs).
* `ingress.py` — the HTTP front: document affinity through Serve model multiplexing keyed by
  document id, the cluster's document registry, retries when a replica dies, `/health`.
* `replica.py` — one engine + pool + the `polykv.server` app per Ray actor.
* `publish.py` — a document's compressed KV as a one-document pool save (object store or a shared
  store), loaded by other replicas with `SharedKVPool.load`'s checks instead of a second prefill.
* `asgi.py` — one HTTP request through an in-process ASGI app, as Python values.

Importing `polykv` or `polykv.ray` does not import ray; `build_app` and `serve_ray` do
(`pip install 'polykv-engine[ray]'`).
"""

from __future__ import annotations

__all__ = ["build_app", "serve_ray", "start_serve"]


def __getattr__(name):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'polykv.ray' has no attribute {name!r}")
