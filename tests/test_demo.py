import json

import pytest
import torch


@pytest.mark.model
def test_demo_small():
    from polykv.demo import format_demo, run_demo

    torch.set_num_threads(1)
    r = run_demo(agents=2, max_new_tokens=12)
    json.dumps(r)
    for key in ("agents", "doc_tokens", "answers", "kv_bytes_shared", "kv_bytes_naive_f16", "ratio"):
        assert key in r
    assert r["agents"] == 2 and len(r["answers"]) == 2 and r["doc_tokens"] > 1000
    assert r["kv_bytes_naive_f16"] > 2 * r["kv_bytes_naive_f16_single"] > 0
    assert r["ratio"] > 4
    assert "ratio" in format_demo(r)
