"""`polykv.bench.offload` on the CPU with a toy model: the same code the GPU run uses, one row per
(ctx, agents, tier), the host tier really streamed (the pool's document moved to host memory)."""

from polykv.bench.offload import bench_offload


def test_bench_offload_rows_per_tier_cpu():
    r = bench_offload(agents=(1, 2), ctxs=(192,), layers=1, suffix_tokens=3, steps=1, warmup=1, chunk=64,
                      stream_chunk_rows=64, device="cpu", tiny=True)
    rows = r["rows"]
    assert [(x["agents"], x["tier"]) for x in rows] == [
        (1, "gpu"), (1, "host"), (1, "offloaded"), (2, "gpu"), (2, "host"), (2, "offloaded")]
    for x in rows:
        assert {"agents", "ctx", "tier", "ms", "h2d_gbps", "h2d_peak_gbps"} <= set(x)  # DESIGN §6 fields
    assert all(x["doc_tier"] == x["tier"] for x in rows if x["tier"] != "offloaded")  # really moved
    host = [x for x in rows if x["tier"] == "host"]
    # the streamed bytes are the document's measured compressed prefix (both K and V, every layer)
    assert all(x["stream_bytes"] > 0 and x["ms"] > 0 and x["ms_gpu_tier"] > 0 for x in host)
    # the same packed data read from either tier gives the same logits (CPU: the same reference)
    assert all(x["argmax_agree"] == 1.0 and x["logits_max_abs_diff"] <= 2e-6 for x in host)
    assert all(x["skipped"] for x in rows if x["tier"] == "offloaded")  # transformers offloading: CUDA only
    assert r["config"]["device"] == "cpu"
