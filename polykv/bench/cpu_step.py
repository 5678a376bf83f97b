"""Plain pool decode steps on the CPU, and the codec decodes inside them (issue F: the CPU path).

    python -m polykv.bench.cpu_step [--threads 1] [--out FILE.json]      # SmolLM2, the demo document

On the CPU the pool's attention is `kernels.reference`: every step decodes the shared document's
compressed rows of every layer once for all agents (no dense copy is kept), so a codec's decode is
a fixed part of each step. Per K / V pair (the default q8_0 / turbo3; turbo4 / turbo2, max's
types) and agent count: the median over `repeats` greedy runs of `pool.last_generate["step_ms"]`
(each run's median ms per plain decode step, pipelined, prefill excluded), and the document's
`add_document` seconds. `decode_us`: each codec's `decode_rotated` of one layer of the document's
rows ([1, Hkv, rows, head_dim], the call a step makes per layer), median µs.
`tiny=True`: a random two-layer Llama and token ids (the smoke test).
"""

from __future__ import annotations

import json
import re
import statistics
import time

import torch

PAIRS = (("q8_0", "turbo3"), ("turbo4", "turbo2"))


def _decode_us(pool, doc: str, names, repeats: int = 20) -> dict:
    """Median µs of each codec's decode_rotated of one layer's worth of document rows (random
    values of layer 0's shape: a step's call per layer)."""
    from ..codecs import get_codec

    lay = pool.layout[0]
    rows = len(pool._docs[doc].ids)
    x = torch.randn(1, lay.num_kv_heads, rows, lay.head_dim, generator=torch.Generator().manual_seed(0))
    out = {}
    for name in names:
        codec = get_codec(name, lay.head_dim)
        packed = codec.encode(x)
        codec.decode_rotated(packed)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            codec.decode_rotated(packed)
            times.append((time.perf_counter() - t) * 1e6)
        out[name] = round(statistics.median(times), 1)
    return out


def run(model=None, tok=None, text: str | None = None, agents=(1, 4), pairs=PAIRS, new_tokens: int = 16,
        repeats: int = 3, tiny: bool = False, log=print) -> dict:
    from ..pool import SharedKVPool

    if tiny:
        from .e2e import build_model
        from .tier_budget import _IdTok

        model, tok = build_model(2, torch.device("cpu"), torch.float32, tiny=True), _IdTok()
        g = torch.Generator().manual_seed(1)
        text = torch.randint(0, model.config.vocab_size, (200,), generator=g).tolist()
        prompts = [torch.randint(0, model.config.vocab_size, (8,), generator=g).tolist() for _ in range(max(agents))]
    else:
        if model is None:
            from ..hf.loading import load_model

            model, tok = load_model()
        if text is None:
            from ..demo import DATA

            # the file's paragraphs unwrapped, as `bench spec` reads it
            text = re.sub(r"(?<=\S)\n(?=\S)", " ", (DATA / "demo_document.md").read_text(encoding="utf-8"))
        from .spec import WORKLOADS

        prompts = WORKLOADS["quoting"]
    rows = []
    for k, v in pairs:
        pool = SharedKVPool(model, tok, k=k, v=v, progress=False)
        t = time.perf_counter()
        doc = pool.add_document(text, name="bench")
        prefill_s = time.perf_counter() - t
        for n in agents:
            qs = list(prompts[:n])
            pool.generate(doc, qs, max_new_tokens=4)  # warm-up
            ms = []
            for _ in range(repeats):
                pool.generate(doc, qs, max_new_tokens=new_tokens)
                ms.append(pool.last_generate["step_ms"]["by_width"][0])
            row = dict(k=k, v=v, agents=n, step_ms=round(statistics.median(ms), 1),
                       step_ms_runs=[round(x, 1) for x in ms], add_document_s=round(prefill_s, 2))
            rows.append(row)
            log(f"{k}/{v} agents {n}: {row['step_ms']} ms per step (runs {row['step_ms_runs']})")
        rows[-1]["decode_us"] = _decode_us(pool, doc, (k, v))
        log(f"{k}/{v} decode of one layer's document rows: {rows[-1]['decode_us']} us")
    return dict(rows=rows, torch_threads=torch.get_num_threads(), new_tokens=new_tokens, repeats=repeats,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), torch=torch.__version__)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--agents", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(agents=tuple(int(x) for x in a.agents.split(",")), repeats=a.repeats)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
