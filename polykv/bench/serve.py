"""Bounded loopback load generator for the HTTP server.

    from polykv.bench.serve import bench_serve
    bench_serve(n_clients=32, requests_per_client=100, max_tokens=8, malformed=0.05, over_budget=0.05)

Starts its own server (in-process uvicorn in a thread on a free 127.0.0.1 port) over one shared
document and runs `n_clients` concurrent clients. Each client sends its requests one after the other;
the requests of all clients are one seeded shuffle of three classes, dealt round-robin:

* good (`n_clients x requests_per_client`): a streaming (SSE) chat completion over the shared
  document, sampled with a per-request seed. Completed: status 200, then chunks, a usage chunk and
  `[DONE]`.
* malformed (`malformed x` the good count, on top): one of `malformed_cases` in turn — bad JSON,
  wrong field types, an unknown document, out-of-range parameters, on the chat and document routes.
  Each must get a 4xx (the case's expected status is recorded too), never a 5xx.
* over_budget (`over_budget x` the good count, on top): a document add whose compressed KV alone
  exceeds the server's KV budget: must get 429 with Retry-After. With over_budget > 0 the server runs
  with `budget_bytes` = the shared document + 2 x the measured suffix storage of `n_clients` agents
  of the longest good request, so the good load always fits; the over-budget document has the
  fewest tokens whose computed compressed bytes exceed 1.1 x the budget.

Outcome of a request: answered (any HTTP status; for a good request also an error event inside its
stream) or lost (no answer: the time limit or the per-request timeout passed, the connection failed,
or a stream ended without `[DONE]`). Bounded in count (the plan above) and in time (`time_limit_s`:
whatever has not finished by then is lost and the run stops). The server and its engine thread are
shut down before returning.

Figures: per class counts; `http_5xx` over all classes (a stream's error event of type
server_error counts); throughput (good completions and their tokens per second of wall time);
latency and time to first token (first content chunk) p50/p99 of good requests; answer time of the
bad classes; `clean` when every good request completed, every malformed one got a 4xx, every
over-budget one a 429 with Retry-After, and nothing got a 5xx or was lost.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import statistics
import time

__all__ = ["bench_serve", "bench_serve_ray", "malformed_cases"]

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

OVER_BUDGET_FILLER = ("Annex to the memo: an inventory of the harbour archive, shelf by shelf, with letters, maps, "
                      "ledgers and photographs sorted by decade and by the family that gave them. ")

CHAT = "/v1/chat/completions"
DOCS = "/v1/documents"


def malformed_cases(doc: str) -> list[tuple[str, int, str, bytes]]:
    """(name, expected status, path, request body) of every malformed request the load sends."""
    base = {"document": doc, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": QUESTIONS[0]}]}

    def chat(**kw) -> bytes:
        return json.dumps({**base, **kw}).encode()

    return [
        ("bad_json", 400, CHAT, chat()[:-7]),
        ("max_tokens_string", 400, CHAT, chat(max_tokens="8")),
        ("messages_not_a_list", 400, CHAT, chat(messages=QUESTIONS[0])),
        ("unknown_document", 404, CHAT, chat(document="doc-0000000000000000")),
        ("document_not_a_string", 400, CHAT, chat(document=12345)),
        ("temperature_out_of_range", 400, CHAT, chat(temperature=9.5)),
        ("top_p_out_of_range", 400, CHAT, chat(top_p=1.5)),
        ("max_tokens_zero", 400, CHAT, chat(max_tokens=0)),
        ("max_tokens_over_cap", 400, CHAT, chat(max_tokens=10**9)),
        ("unknown_role", 400, CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
        ("empty_messages", 400, CHAT, chat(messages=[])),
        ("n_two", 400, CHAT, chat(n=2)),
        ("document_text_not_a_string", 400, DOCS, json.dumps({"text": 42}).encode()),
        ("document_text_empty", 400, DOCS, json.dumps({"text": ""}).encode()),
    ]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


def _r(x):
    return None if x is None else round(x, 4)


def _plan(n_clients: int, per_client: int, malformed: float, over_budget: float, n_cases: int,
          seed: int) -> list[list[tuple[str, int]]]:
    """Per client, its requests in order: (class, index) with index the good request's number, the
    malformed case or the over-budget request's number."""
    good = n_clients * per_client
    tasks = [("good", i) for i in range(good)]
    tasks += [("malformed", i % n_cases) for i in range(round(malformed * good))]
    tasks += [("over_budget", i) for i in range(round(over_budget * good))]
    random.Random(seed).shuffle(tasks)
    return [tasks[c::n_clients] for c in range(n_clients)]


class _Tally:
    """Outcomes, written by the client coroutines of one event loop."""

    def __init__(self):
        self.lat: list[float] = []
        self.ttft: list[float] = []
        self.tokens = 0
        self.completed = 0
        self.good_errors: list[str] = []
        self.statuses: dict[str, dict[int, int]] = {"good": {}, "malformed": {}, "over_budget": {}}
        self.cases: dict[str, dict[int, int]] = {}
        self.answered = {"good": 0, "malformed": 0, "over_budget": 0}
        self.answer_s: dict[str, list[float]] = {"malformed": [], "over_budget": []}
        self.retry_after = 0
        self.http_5xx = 0
        self.lost_samples: list[str] = []
        self.bad_samples: list[str] = []

    def status(self, cls: str, status: int) -> None:
        self.statuses[cls][status] = self.statuses[cls].get(status, 0) + 1
        self.answered[cls] += 1
        if status >= 500:
            self.http_5xx += 1


async def _load(url: str, doc_id: str | list[str], model_name: str, plan: list[list[tuple[str, int]]],
                max_tokens: int, over_text: str | None, deadline: float, request_timeout: float) -> _Tally:
    """Run `plan` against `url`. `doc_id`: the shared document, or several: good request i goes over
    doc_ids[i % len(doc_ids)] (the same load on each)."""
    import httpx

    doc_ids = [doc_id] if isinstance(doc_id, str) else list(doc_id)
    doc_id = doc_ids[0]
    t = _Tally()
    cases = malformed_cases(doc_id)
    over_body = json.dumps({"text": over_text, "name": "over-budget"}).encode() if over_text else None
    headers = {"Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=request_timeout, limits=limits) as client:

        async def good(i: int) -> None:
            body = {"model": model_name, "document": doc_ids[i % len(doc_ids)], "max_tokens": max_tokens,
                    "temperature": 0.7, "top_p": 0.95, "seed": i, "stream": True,
                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = usage = None
            async with client.stream("POST", CHAT, json=body) as r:
                if r.status_code != 200:
                    t.status("good", r.status_code)
                    t.good_errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:  # answered with an error inside the stream
                        t.status("good", 500 if obj["error"].get("type") == "server_error" else 400)
                        t.good_errors.append(f"stream error: {str(obj['error'])[:200]}")
                        return
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if first is None and obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                else:
                    raise ConnectionError("stream ended without [DONE]")
            if usage is None:
                raise ConnectionError("stream ended without a usage chunk")
            t.status("good", 200)
            t.lat.append(time.perf_counter() - t0)
            if first is not None:
                t.ttft.append(first)
            t.tokens += usage["completion_tokens"]
            t.completed += 1

        async def bad(cls: str, path: str, content: bytes, name: str, expect: int) -> None:
            t0 = time.perf_counter()
            r = await client.post(path, content=content, headers=headers)
            t.answer_s[cls].append(time.perf_counter() - t0)
            t.status(cls, r.status_code)
            if cls == "malformed":
                row = t.cases.setdefault(name, {})
                row[r.status_code] = row.get(r.status_code, 0) + 1
            elif r.status_code == 429 and r.headers.get("retry-after", "").isdigit():
                t.retry_after += 1
            if r.status_code != expect and len(t.bad_samples) < 5:
                t.bad_samples.append(f"{cls} {name}: {r.status_code} {r.text[:200]}")

        async def one(cls: str, i: int) -> None:
            if cls == "good":
                await good(i)
            elif cls == "malformed":
                name, expect, path, content = cases[i]
                await bad(cls, path, content, name, expect)
            else:
                await bad(cls, DOCS, over_body, "document over the KV budget", 429)

        async def client_loop(tasks: list[tuple[str, int]]) -> None:
            for cls, i in tasks:
                if time.monotonic() >= deadline:
                    return
                try:
                    await asyncio.wait_for(one(cls, i), max(0.1, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    return  # the time limit: this request and the rest of this client are lost
                except Exception as exc:  # transport errors, timeouts, cut streams: lost
                    if len(t.lost_samples) < 5:
                        t.lost_samples.append(f"{cls}: {type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(client_loop(tasks) for tasks in plan))
    return t


def _suffix_agent_bytes(state, handle, n_agents: int, rows: int) -> int:
    """Engine thread: measured suffix storage of `n_agents` agents of `rows` rows over `handle`."""
    with state.pool.open_batch(handle) as b:
        b.reserve([rows] * n_agents)
        return b.nbytes()


def _over_budget_text(state, budget: int) -> tuple[str, int]:
    """A document whose computed compressed bytes exceed 1.1 x `budget`, and its token count."""
    need = math.ceil(1.1 * budget)
    per = state.prefix_bytes(1)
    if per is None or not hasattr(state.pool, "_doc_tokens"):
        raise ValueError("over-budget requests need the shared pool (its KV layout and codecs)")
    n = max(1, need // per)
    while state.prefix_bytes(n) <= need:
        n += max(1, n // 16)
    unit = len(state.encode(OVER_BUDGET_FILLER))
    text = OVER_BUDGET_FILLER * (n // unit + 2)
    tokens = len(state.pool._doc_tokens(text)[0])
    if tokens >= state.context_length:
        raise ValueError(f"an over-budget document would need {tokens} tokens, beyond the model's context "
                         f"({state.context_length}): use fewer clients or no over-budget requests")
    return text, tokens


def bench_serve(n_clients: int = 32, requests_per_client: int = 8, max_tokens: int = 16, model=None,
                k: str = "q8_0", v: str = "turbo3", document: str | None = None, time_limit_s: float = 900.0,
                request_timeout_s: float = 600.0, max_agents: int = 64, torch_threads: int | None = None,
                malformed: float = 0.0, over_budget: float = 0.0, seed: int = 0, _model_tok=None) -> dict:
    """Run the bounded load and return a dict of figures (see module doc).

    `model`: as for `polykv.load_model` (None: the embedded SmolLM2). `torch_threads`: intra-op threads
    for the engine (None: torch's default; 1 is much faster on an oversubscribed shared CPU).
    `malformed`, `over_budget`: those requests as fractions of the good ones, added on top. `seed`:
    the shuffle of the classes. `_model_tok`: an already loaded (model, tokenizer) pair (tests).
    Everything is stopped before returning, also on errors.
    """
    import httpx

    from ..server import ServerThread, build_pool, create_app
    from ..server.prompts import chat_suffix_ids

    if not (0 <= malformed <= 1 and 0 <= over_budget <= 1):
        raise ValueError("malformed and over_budget are fractions in [0, 1]")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if _model_tok is not None:
        m, tok = _model_tok
        name = "test-model"
    else:
        from ..hf.loading import load_model

        m, tok = load_model(model)
        name = str(model or "smollm2-135m")
    pool = build_pool(m, tok, k=k, v=v)
    app = create_app(pool, model_name=name, k=k, v=v,
                     engine_kwargs={"max_agents": max_agents, "num_threads": torch_threads})
    state = app.state.polykv
    cases = malformed_cases("")
    plan = _plan(n_clients, requests_per_client, malformed, over_budget, len(cases), seed)
    planned = {c: sum(1 for tasks in plan for cls, _ in tasks if cls == c)
               for c in ("good", "malformed", "over_budget")}
    budget = over_text = over_tokens = None
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + DOCS, json={"text": document or DEFAULT_DOC, "name": "bench"},
                       timeout=request_timeout_s)
        r.raise_for_status()
        doc = r.json()
        if planned["over_budget"]:
            handle = state.docs[doc["id"]]["_handle"]
            rows = max_tokens + max(len(chat_suffix_ids(state, handle, [{"role": "user", "content": q}]))
                                    for q in QUESTIONS)
            agents = state.engine.call(_suffix_agent_bytes, state, handle, n_clients, rows).result(timeout=600)
            budget = doc["bytes"] + 2 * agents
            over_text, over_tokens = _over_budget_text(state, budget)
            pool.budget_bytes = budget
        steps0 = state.engine.steps
        load_start = time.monotonic()
        deadline = load_start + time_limit_s
        t = asyncio.run(_load(srv.url, doc["id"], name, plan, max_tokens, over_text, deadline,
                              request_timeout_s))
        # the load's wall time on the deadline's clock: from the moment the time limit starts
        wall = time.monotonic() - load_start
        mem = state.engine.call(state.memory_sync).result(timeout=600)
        steps = state.engine.steps - steps0
        doc_after = httpx.get(srv.url + DOCS, timeout=60).json()["data"]
    good_err = len(t.good_errors)
    classes = {
        "good": {"planned": planned["good"], "completed": t.completed, "errors": good_err,
                 "lost": planned["good"] - t.answered["good"], "statuses": _keys(t.statuses["good"])},
        "malformed": {"planned": planned["malformed"],
                      "answered_4xx": sum(n for s, n in t.statuses["malformed"].items() if 400 <= s < 500),
                      "as_expected": sum(t.cases.get(nm, {}).get(exp, 0) for nm, exp, _, _ in cases),
                      "lost": planned["malformed"] - t.answered["malformed"],
                      "statuses": _keys(t.statuses["malformed"]),
                      "by_case": {nm: {"expected": exp, "statuses": _keys(t.cases.get(nm, {}))}
                                  for nm, exp, _, _ in cases},
                      "answer_p50_s": _r(_pct(t.answer_s["malformed"], 50)),
                      "answer_p99_s": _r(_pct(t.answer_s["malformed"], 99))},
        "over_budget": {"planned": planned["over_budget"], "answered_429": t.statuses["over_budget"].get(429, 0),
                        "with_retry_after": t.retry_after, "lost": planned["over_budget"] - t.answered["over_budget"],
                        "statuses": _keys(t.statuses["over_budget"]), "document_tokens": over_tokens,
                        "answer_p50_s": _r(_pct(t.answer_s["over_budget"], 50)),
                        "answer_p99_s": _r(_pct(t.answer_s["over_budget"], 99))},
    }
    lost = sum(c["lost"] for c in classes.values())
    clean = (t.completed == planned["good"] and t.http_5xx == 0 and lost == 0
             and classes["malformed"]["answered_4xx"] == planned["malformed"]
             and classes["over_budget"]["answered_429"] == classes["over_budget"]["with_retry_after"]
             == planned["over_budget"])
    return {
        "clients": n_clients, "requests_per_client": requests_per_client, "requests": planned["good"],
        "requests_total": sum(planned.values()),
        "completed": t.completed, "errors": good_err, "lost": classes["good"]["lost"],
        "error_samples": t.good_errors[:5], "lost_samples": t.lost_samples, "unexpected_samples": t.bad_samples,
        "classes": classes, "http_5xx": t.http_5xx, "lost_all": lost, "clean": clean,
        "documents_after": len(doc_after),
        "max_tokens": max_tokens, "completion_tokens": t.tokens,
        "wall_s": round(wall, 3), "time_limit_s": time_limit_s,
        "req_per_s": round(t.completed / wall, 3) if wall else None,
        "answers_per_s": round(sum(t.answered.values()) / wall, 3) if wall else None,
        "tok_per_s": round(t.tokens / wall, 2) if wall else None,
        "latency_p50_s": _r(_pct(t.lat, 50)), "latency_p99_s": _r(_pct(t.lat, 99)),
        "latency_mean_s": _r(statistics.fmean(t.lat)) if t.lat else None,
        "ttft_p50_s": _r(_pct(t.ttft, 50)), "ttft_p99_s": _r(_pct(t.ttft, 99)),
        "engine_steps": steps,
        "doc_tokens": doc["tokens"], "kv_bytes_shared": mem.get("kv_bytes_shared"),
        "kv_bytes_naive_f16": mem.get("kv_bytes_naive_f16"), "budget_bytes": budget,
        "model": name, "k": k, "v": v, "pool": type(pool).__name__, "seed": seed,
        "torch_threads": torch_threads, "started_utc": started,
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, {platform.system()}, "
                   f"python {platform.python_version()}",
    }


SECOND_DOC = (
    "Timetable note of the Varnholm ferry. The first boat leaves the north pier at seven and the last returns "
    "at eight in the evening. Bicycles travel free; cars must be booked a day ahead at the harbour office. In "
    "winter storms the crossing is cancelled and the siren on the breakwater sounds twice. "
) * 3


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux /proc; None elsewhere or when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _ray_side_pids(exclude: set[int]) -> list[int]:
    """This process (the load generator) and Ray's processes on this machine (proxy, ingress,
    controller, GCS, raylet, agents: command lines naming ray), minus `exclude` (the replicas)."""
    pids = [os.getpid()]
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for e in entries:
        if not e.isdigit() or int(e) in exclude or int(e) == os.getpid():
            continue
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"ray::" in cmd or b"/ray/" in cmd:
            pids.append(int(e))
    return pids


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait
    except (OSError, ValueError, IndexError):
        return None


def _parse_configs(configs) -> list[tuple[int, int]]:
    """"1x1,1x2,2x1" (replicas x torch threads per replica) or [(replicas, threads), ...]."""
    if isinstance(configs, str):
        out = []
        for part in configs.split(","):
            r, _, t = part.strip().partition("x")
            out.append((int(r), int(t or 1)))
        configs = out
    configs = [(int(r), int(t)) for r, t in configs]
    if not configs or any(r < 1 or t < 1 for r, t in configs):
        raise ValueError(f"configs are replicas x threads with both >= 1, got {configs}")
    return configs


def bench_serve_ray(configs="1x1,1x2,2x1", n_clients: int = 16, requests_per_client: int = 4,
                    max_tokens: int = 16, model=None, k: str = "q8_0", v: str = "turbo3",
                    time_limit_s: float = 600.0, request_timeout_s: float = 600.0, seed: int = 0,
                    log=None) -> dict:
    """`polykv serve --ray` on this machine under the same load for each config, one after the other.

    configs: replicas x torch threads per replica ("1x1,1x2,2x1": one replica with one thread, one with
    two, two with one each); each replica gets `threads` CPUs from Ray. Per config: a local Ray
    instance (or the running one) with Serve's HTTP proxy on a free loopback port, the application
    deployed, two documents added (the second add goes to the replica with the fewest documents),
    one warm-up request per document, then `n_clients` concurrent streaming chat clients x
    `requests_per_client` requests, alternating the two documents (temperature 0.7, per-request
    seeds), bounded by `time_limit_s`. Measured per config: completed / lost, tokens/s, latency,
    where each document lives, prefills and loads, and the CPU seconds spent during the load by each
    replica process, by this process (the clients) with Ray's own processes (proxy, ingress,
    controller, GCS, raylet), and by the whole machine (the rest: other users) — what bounds the
    scaling on a small shared CPU. The application
    is deleted after each config; Ray is shut down at the end if this call started it.
    `ratio`: tokens/s of the best multi-replica config over the best single-replica one.
    """
    import httpx
    import ray
    from ray import serve

    from ..ray import build_app
    from ..ray.app import PROXY_READY_ENV, PROXY_READY_S, start_serve
    from ..server import free_port

    log = log or (lambda msg: None)
    configs = _parse_configs(configs)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cores = os.cpu_count() or 1
    own_ray = not ray.is_initialized()
    if own_ray:
        os.environ.setdefault(PROXY_READY_ENV, PROXY_READY_S)
        ray.init(num_cpus=max(cores, max(r * t for r, t in configs)), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
    name = str(model or "smollm2-135m")
    rows = []
    try:  # whatever fails (an actor dying under load, in serve.start too), the Ray we started stops
        port = free_port()
        start_serve({"host": "127.0.0.1", "port": port}, note=log)
        url = f"http://127.0.0.1:{port}"
        for replicas, threads in configs:
            log(f"bench serve --ray: {replicas} replica(s) x {threads} thread(s): deploying")
            serve.run(build_app(replicas=replicas, cpus_per_replica=threads, torch_threads=threads, model=model,
                                k=k, v=v, max_ongoing_requests=max(32, n_clients)), name="polykv", route_prefix="/")
            try:
                rows.append(_ray_round(url, replicas, threads, n_clients, requests_per_client, max_tokens, name,
                                       time_limit_s, request_timeout_s, seed, log, httpx))
            finally:
                _teardown(lambda: serve.delete("polykv"), log)
    finally:
        try:
            _teardown(serve.shutdown, log)
        finally:
            if own_ray:
                ray.shutdown()
    singles = [r["tok_per_s"] for r in rows if r["replicas"] == 1 and r["tok_per_s"]]
    multis = [r["tok_per_s"] for r in rows if r["replicas"] > 1 and r["tok_per_s"]]
    ratio = round(max(multis) / max(singles), 3) if singles and multis else None
    return {"rows": rows, "ratio": ratio, "clients": n_clients, "requests_per_client": requests_per_client,
            "max_tokens": max_tokens, "documents": 2, "model": name, "k": k, "v": v, "seed": seed,
            "lost": sum(r["lost"] for r in rows), "started_utc": started, "cores": cores,
            "machine": f"{platform.machine()} {cores} cpu, {platform.system()}, python {platform.python_version()}"}


def _teardown(fn, log) -> None:
    """Run a Ray Serve teardown step; its failure is logged, not raised: the rows were measured, and
    under load Serve's controller can die while it shuts down (ActorDiedError from its
    graceful_shutdown, seen in CI on a loaded 2-core machine)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - any Ray error here ends nothing the run measured
        log(f"bench serve --ray: {getattr(fn, '__name__', fn)} failed ({exc!r}); the results stand")


def _ray_round(url, replicas, threads, n_clients, per_client, max_tokens, name, time_limit_s, request_timeout_s,
               seed, log, httpx) -> dict:
    def health() -> dict:
        return httpx.get(url + "/health", timeout=60).json()

    def wait(cond, timeout: float = 300.0) -> dict:
        t_end = time.monotonic() + timeout
        while True:
            try:
                h = health()
                if cond(h):
                    return h
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > t_end:
                raise TimeoutError(f"the application did not reach the expected state in {timeout} s")
            time.sleep(0.25)

    wait(lambda h: len(h["replicas"]) == replicas)
    docs = []
    for i, text in enumerate((DEFAULT_DOC, SECOND_DOC)):
        r = httpx.post(url + DOCS, json={"text": text, "name": f"bench-{i}"}, timeout=request_timeout_s)
        r.raise_for_status()
        did, rep = r.json()["id"], r.headers.get("x-polykv-replica")
        wait(lambda h: any(did in x["documents"] and x["replica"] == rep for x in h["replicas"]), 60)
        time.sleep(1.0)  # Serve's routers learn the holder (a push every 0.1 s, then a broadcast)
        docs.append(did)
    for did in docs:  # warm-up: each document's first batch
        httpx.post(url + CHAT, json={"document": did, "max_tokens": 2, "temperature": 0,
                                     "messages": [{"role": "user", "content": QUESTIONS[0]}]},
                   timeout=request_timeout_s).raise_for_status()
    h0 = health()
    pids = {x["replica"]: x["pid"] for x in h0["replicas"]}
    cpu0 = {rid: _cpu_s(pid) for rid, pid in pids.items()}
    side = _ray_side_pids(set(pids.values()))
    side0 = {pid: _cpu_s(pid) for pid in side}
    busy0 = _machine_busy_s()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    plan = _plan(n_clients, per_client, 0.0, 0.0, 1, seed)
    log(f"bench serve --ray: {replicas} x {threads}: load of {n_clients} clients x {per_client} requests")
    t0 = time.monotonic()
    t = asyncio.run(_load(url, docs, name, plan, max_tokens, None, t0 + time_limit_s, request_timeout_s))
    wall = time.monotonic() - t0
    busy = _machine_busy_s()
    side_cpu = sum(max(0.0, (_cpu_s(pid) or 0.0) - c0) for pid, c0 in side0.items() if c0 is not None)
    h1 = health()
    cpu = {rid: (None if cpu0.get(rid) is None or _cpu_s(pid) is None else round(_cpu_s(pid) - cpu0[rid], 2))
           for rid, pid in pids.items()}
    planned = n_clients * per_client
    return {
        "replicas": replicas, "torch_threads": threads, "requests": planned, "completed": t.completed,
        "errors": len(t.good_errors), "lost": planned - t.answered["good"], "error_samples": t.good_errors[:3],
        "lost_samples": t.lost_samples[:3], "completion_tokens": t.tokens, "wall_s": round(wall, 3),
        "tok_per_s": round(t.tokens / wall, 2) if wall else None,
        "req_per_s": round(t.completed / wall, 3) if wall else None,
        "latency_p50_s": _r(_pct(t.lat, 50)), "latency_p99_s": _r(_pct(t.lat, 99)),
        "ttft_p50_s": _r(_pct(t.ttft, 50)), "ttft_p99_s": _r(_pct(t.ttft, 99)),
        "placement": {x["replica"]: x["documents"] for x in h1["replicas"]},
        "requests_by_replica": {x["replica"]: x["requests"] - next((y["requests"] for y in h0["replicas"]
                                                                   if y["replica"] == x["replica"]), 0)
                                for x in h1["replicas"]},
        "prefills": h1["prefills"], "loads": h1["loads"], "retries": h1["retries"],
        "replica_cpu_s": cpu,
        "ray_and_client_cpu_s": round(side_cpu, 2),
        "machine_busy_cpu_s": None if busy is None or busy0 is None else round(busy - busy0, 2),
        "machine_cpu_capacity_s": round(wall * (os.cpu_count() or 1), 2),
        "loadavg_1m_before_after": [load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
    }


def _keys(d: dict) -> dict:
    return {str(k): v for k, v in sorted(d.items())}


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--malformed", type=float, default=0.0)
    ap.add_argument("--over-budget", type=float, default=0.0)
    a = ap.parse_args()
    print(json.dumps(bench_serve(a.clients, a.requests, a.max_tokens, a.model, time_limit_s=a.time_limit,
                                 torch_threads=a.torch_threads, malformed=a.malformed, over_budget=a.over_budget),
                     indent=2))
