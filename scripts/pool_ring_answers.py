"""Greedy answers of SharedKVPool agents with and without the recent window (polykv.pool.ring),
against an f16 pool: needle recall and answer agreement (docs/pool.md, "Recent windows").

Prompts: the bundled needle prompts (20, names and places in Pride and Prejudice, ~1k tokens) and the
code needles of issue K whose context is ~1k tokens (`ctx` <= 1024: random codes, numbers and
passwords; 16). Each context is a pool document (chat template: the context opens the user turn),
the question one agent's suffix; `pool.generate(..., max_new_tokens)` greedy.

    python scripts/pool_ring_answers.py --configs f16:0 default:0 default:8 balanced:0 balanced:32 \
        max:0 max:8 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def prompts() -> list[dict]:
    from polykv.eval.common import data_path

    rows = [json.loads(l) for l in data_path("needle_prompts.jsonl").read_text().splitlines() if l.strip()]
    codes = [json.loads(l) for l in data_path("code_prompts.jsonl").read_text().splitlines() if l.strip()]
    return [dict(r, set="needles") for r in rows] + [dict(r, set="codes") for r in codes if int(r["ctx"]) <= 1024]


def main(argv=None) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from pool_ring_ppl import make_pool

    from polykv import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", nargs="+", default=["f16:0", "default:0", "default:8"])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, tok = load_model(a.model)
    ps = prompts()[: a.limit or None]
    answers, rows = {}, []
    for spec in a.configs:
        t0 = time.time()
        pool = make_pool(model, tok, spec)
        got = []
        for p in ps:
            doc = pool.add_document(p["context"])
            got.append(pool.generate(doc, [p["question"]], max_new_tokens=a.max_new_tokens)[0])
            pool.remove_document(doc)
        answers[spec] = got
        row = dict(config=spec, recent=pool.recent, seconds=round(time.time() - t0, 1))
        for s in ("needles", "codes"):
            idx = [i for i, p in enumerate(ps) if p["set"] == s]
            row[f"recall_{s}"] = f"{sum(ps[i]['needle'] in got[i] for i in idx)}/{len(idx)}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    ref = answers.get("f16:0")
    for r in rows:
        if ref is not None:
            same = [answers[r["config"]][i] == ref[i] for i in range(len(ps))]
            r["same_as_f16"] = f"{sum(same)}/{len(ps)}"
        for other in rows:  # agreement of each windowed config with its own R = 0
            if other["config"].split(":")[0] == r["config"].split(":")[0] and other is not r \
                    and other["recent"] == 0 and r["recent"]:
                r["same_as_r0"] = f"{sum(x == y for x, y in zip(answers[r['config']], answers[other['config']]))}/{len(ps)}"
    res = dict(prompts=len(ps), max_new_tokens=a.max_new_tokens, rows=rows, answers=answers,
               needles=[p["needle"] for p in ps])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(rows))
    return res


if __name__ == "__main__":
    main()
