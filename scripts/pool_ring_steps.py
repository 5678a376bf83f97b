"""Decode step time of SharedKVPool agents with and without the recent window (docs/pool.md,
"Recent windows"): SmolLM2, a 1,024-token document (Pride and Prejudice), 4 agents with 16-token
prompts taken from it, `generate(max_new_tokens=32)` (pipelined, greedy) three times per R; prints
each call's median plain-step time (`last_generate["step_ms"]["by_width"][0]`) and the median of
the three.

    python scripts/pool_ring_steps.py        # R = 0, 8, 32 of the default pair (q8_0 / turbo3)
"""

import json

import torch

from polykv import load_model
from polykv.eval.common import load_text
from polykv.pool import SharedKVPool

torch.set_num_threads(1)
m, t = load_model()
ids = t(load_text(None), add_special_tokens=False)["input_ids"][:1024]
qs = [[int(x) for x in ids[100 + 50 * i: 116 + 50 * i]] for i in range(4)]
out = {}
for R in (0, 8, 32):
    pool = SharedKVPool(m, t, preset="default", recent=R, progress=False)
    doc = pool.add_document(ids)
    pool.generate(doc, qs, max_new_tokens=4)  # warm-up
    res = []
    for _ in range(3):
        pool.generate(doc, qs, max_new_tokens=32)
        res.append(pool.last_generate["step_ms"]["by_width"][0])
    out[R] = sorted(res)[1]
    print(R, [round(x, 1) for x in res], flush=True)
print(json.dumps(out))
