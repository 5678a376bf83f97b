"""The server's scale-out on Ray Serve (DESIGN §2 names it here): `polykv serve --ray`.

The application lives in `polykv.ray` (ingress, replicas, publishing of documents); this module only
re-exports its entry points, lazily, so importing `polykv.server` never imports ray.
"""

from __future__ import annotations

__all__ = ["build_app", "serve_ray"]


def __getattr__(name):
    if name in __all__:
        from ..ray import app

        return getattr(app, name)
    raise AttributeError(f"module 'polykv.server.ray_app' has no attribute {name!r}")
