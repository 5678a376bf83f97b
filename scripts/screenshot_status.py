#!/usr/bin/env python
"""Screenshot the polykv status page (GET /) in headless Chromium while agents are running.

    python scripts/screenshot_status.py --out /tmp/status.png                   # SmolLM2, own server
    python scripts/screenshot_status.py --tiny --out /tmp/status.png            # tiny random model
    python scripts/screenshot_status.py --url http://127.0.0.1:8000 --out s.png # an existing server

Without --url it starts an in-process server on a free loopback port, adds one shared document,
keeps --agents streaming requests running over it, lets the page poll /v1/status for a few seconds
(Chromium's virtual time), writes the PNG, then stops the clients and the server (engine joined).
Exit status 0 when the PNG was written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC = ("Internal memo of the Harbor Street library. The reading room opens at nine. Members may borrow up "
       "to six books for three weeks. The rare-books cabinet is locked; its key is kept by the head "
       "librarian. Lost cards are replaced at the front desk for a small fee. ") * 4

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-dev-shm-usage"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def screenshot(url: str, out: Path, width: int = 1200, height: int = 900, wait_ms: int = 4000,
               chromium: str | None = None, timeout: float = 120.0) -> Path:
    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium not found (apt-get install -y chromium)")
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="polykv-chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]
        subprocess.run(cmd, check=True, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not out.is_file() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {out}")
    return out


def _tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from polykv.hf.loading import load_model

    _, tok = load_model()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval(), tok


def run_with_own_server(out: Path, tiny: bool, agents: int, wait_ms: int, torch_threads: int | None = 1) -> Path:
    import httpx

    from polykv.server import ServerThread, build_pool, create_app

    if tiny:
        model, tok = _tiny_model()
        name = "tiny-random"
    else:
        from polykv.hf.loading import load_model

        model, tok = load_model()
        name = "smollm2-135m"
    app = create_app(build_pool(model, tok), model_name=name, engine_kwargs={"num_threads": torch_threads})
    stop = threading.Event()
    with ServerThread(app) as srv:
        doc = httpx.post(srv.url + "/v1/documents", json={"text": DOC, "name": "library-memo"}, timeout=300).json()
        httpx.post(srv.url + "/v1/documents", json={"text": DOC[:300] + " Second copy for the annex.",
                                                     "name": "annex-memo"}, timeout=300)

        def client(i: int) -> None:
            body = {"model": name, "document": doc["id"], "max_tokens": 400, "temperature": 0.8, "seed": i,
                    "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": f"Agent {i}: summarize the memo."}]}
            while not stop.is_set():
                try:
                    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                break
                except httpx.HTTPError:
                    time.sleep(0.1)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(agents)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while httpx.get(srv.url + "/v1/status", timeout=60).json()["live_agents"] < agents and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)  # let the tokens/s window fill
        try:
            return screenshot(srv.url + "/", out, wait_ms=wait_ms)
        finally:
            stop.set()
            for t in threads:
                t.join(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "polykv-status.png"))
    ap.add_argument("--url", default=None, help="screenshot an already running server instead")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (fast; numbers only)")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--wait-ms", type=int, default=4000, help="page time before the shot (virtual)")
    ap.add_argument("--torch-threads", type=int, default=1, help="engine intra-op threads (0: torch default)")
    a = ap.parse_args(argv)
    if a.url:
        path = screenshot(a.url.rstrip("/") + "/", Path(a.out), wait_ms=a.wait_ms)
    else:
        path = run_with_own_server(Path(a.out), a.tiny, a.agents, a.wait_ms, a.torch_threads or None)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
