"""Bounded loopback load generator for the HTTP server.

    from polykv.bench.serve import bench_serve
    bench_serve(n_clients=32, requests_per_client=8, max_tokens=16)

Starts its own server (in-process uvicorn in a thread on a free 127.0.0.1 port) over one shared
document, runs `n_clients` concurrent clients that each send `requests_per_client` chat requests
over that document (greedy-free sampling with per-request seeds), and returns throughput, latency
percentiles, errors and lost requests. Bounded in count (clients x requests) and in time
(`time_limit_s`: whatever has not finished by then is counted as lost and the run stops). The server
and its engine thread are shut down before it returns.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import time

__all__ = ["bench_serve"]

DEFAULT_DOC = (
    "Internal memo of the Harbor Street library. The reading room opens at nine and closes at six. "
    "Members may borrow up to six books for three weeks; renewals are allowed twice. The rare-books "
    "cabinet is locked, and its key is kept by the head librarian. Lost cards are replaced at the front "
    "desk for a small fee. The children's corner hosts a story hour every Saturday at ten. "
) * 3

QUESTIONS = [
    "When does the reading room open?",
    "How many books may a member borrow?",
    "Who keeps the key of the rare-books cabinet?",
    "Where are lost cards replaced?",
    "When is the story hour?",
    "How long is the loan period?",
    "How often can a loan be renewed?",
    "When does the reading room close?",
]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


async def _load(url: str, doc_id: str, model_name: str, n_clients: int, per_client: int, max_tokens: int,
                deadline: float, request_timeout: float) -> dict:
    import httpx

    lat: list[float] = []
    ttft: list[float] = []
    tokens = 0
    errors: list[str] = []
    ok = 0
    limits = httpx.Limits(max_connections=n_clients + 4, max_keepalive_connections=n_clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits) as client:

        async def one(c: int, i: int) -> None:
            nonlocal tokens, ok
            body = {"model": model_name, "document": doc_id, "max_tokens": max_tokens,
                    "temperature": 0.7, "top_p": 0.95, "seed": c * 1000 + i, "stream": True,
                    "messages": [{"role": "user", "content": QUESTIONS[(c + i) % len(QUESTIONS)]}],
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None
            usage = None
            got_done = False
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    return
                import json

                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        got_done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        errors.append(str(obj["error"])[:200])
                        return
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if first is None and obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
            if not got_done or usage is None:
                errors.append("stream ended without [DONE]/usage")
                return
            lat.append(time.perf_counter() - t0)
            if first is not None:
                ttft.append(first)
            tokens += usage["completion_tokens"]
            ok += 1

        async def client_loop(c: int) -> None:
            for i in range(per_client):
                if time.monotonic() >= deadline:
                    return
                try:
                    await asyncio.wait_for(one(c, i), max(0.1, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    return  # counted as lost
                except Exception as exc:  # transport errors
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for c in range(n_clients)))
        wall = time.perf_counter() - t0
    return {"lat": lat, "ttft": ttft, "tokens": tokens, "errors": errors, "ok": ok, "wall": wall}


def bench_serve(n_clients: int = 32, requests_per_client: int = 8, max_tokens: int = 16, model=None,
                k: str = "q8_0", v: str = "turbo3", document: str | None = None, time_limit_s: float = 900.0,
                request_timeout_s: float = 600.0, max_agents: int = 64, torch_threads: int | None = None,
                _model_tok=None) -> dict:
    """Run the bounded load and return a dict of figures (see module doc).

    `model`: as for `polykv.load_model` (None: the embedded SmolLM2). `torch_threads`: intra-op threads
    for the engine (None: torch's default; 1 is much faster on an oversubscribed shared CPU).
    `_model_tok`: an already loaded
    (model, tokenizer) pair (tests). Everything is stopped before returning, also on errors.
    """
    import httpx

    from ..server import ServerThread, build_pool, create_app

    if _model_tok is not None:
        m, tok = _model_tok
        name = "test-model"
    else:
        from ..hf.loading import load_model

        m, tok = load_model(model)
        name = str(model or "smollm2-135m")
    pool = build_pool(m, tok, k=k, v=v)
    app = create_app(pool, model_name=name, k=k, v=v, engine_kwargs={"max_agents": max_agents, "num_threads": torch_threads})
    state = app.state.polykv
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/documents", json={"text": document or DEFAULT_DOC, "name": "bench"},
                       timeout=request_timeout_s)
        r.raise_for_status()
        doc = r.json()
        steps0 = state.engine.steps
        deadline = time.monotonic() + time_limit_s
        res = asyncio.run(_load(srv.url, doc["id"], name, n_clients, requests_per_client, max_tokens, deadline,
                                request_timeout_s))
        mem = state.engine.call(state.memory_sync).result(timeout=600)
        steps = state.engine.steps - steps0
    total = n_clients * requests_per_client
    lost = total - res["ok"] - len(res["errors"])
    lat = res["lat"]
    wall = res["wall"]
    return {
        "clients": n_clients, "requests_per_client": requests_per_client, "requests": total,
        "completed": res["ok"], "errors": len(res["errors"]), "lost": lost,
        "error_samples": res["errors"][:5],
        "max_tokens": max_tokens, "completion_tokens": res["tokens"],
        "wall_s": round(wall, 3),
        "req_per_s": round(res["ok"] / wall, 3) if wall else None,
        "tok_per_s": round(res["tokens"] / wall, 2) if wall else None,
        "latency_p50_s": _r(_pct(lat, 50)), "latency_p99_s": _r(_pct(lat, 99)),
        "latency_mean_s": _r(statistics.fmean(lat)) if lat else None,
        "ttft_p50_s": _r(_pct(res["ttft"], 50)), "ttft_p99_s": _r(_pct(res["ttft"], 99)),
        "engine_steps": steps,
        "doc_tokens": doc["tokens"], "kv_bytes_shared": mem.get("kv_bytes_shared"),
        "kv_bytes_naive_f16": mem.get("kv_bytes_naive_f16"),
        "model": name, "k": k, "v": v, "pool": type(pool).__name__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpu",
    }


def _r(x):
    return None if x is None else round(x, 4)


if __name__ == "__main__":  # pragma: no cover
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=900.0)
    a = ap.parse_args()
    print(json.dumps(bench_serve(a.clients, a.requests, a.max_tokens, a.model, time_limit_s=a.time_limit,
                                 torch_threads=a.torch_threads), indent=2))
