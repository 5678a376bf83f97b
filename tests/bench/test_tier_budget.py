"""`polykv.bench.tier_budget` on the CPU with a toy model: documents totalling 2x the GPU budget are
served from both tiers with one prefill each and the answers of an unbudgeted pool."""

from polykv.bench.tier_budget import run


def test_tier_budget_serves_every_document_without_reprefill_cpu():
    r = run(tiny=True, doc_tokens=160, agents=2, new_tokens=3, log=lambda *_: None)
    assert r["prefills"] == 4 and r["all_resident"]
    assert len(r["rounds"]) == 8 and all(x["same_as_unbudgeted"] for x in r["rounds"])
    assert {x["tier_before"] for x in r["rounds"]} >= {"host"}  # some calls really read the host tier
    assert all(x["tier_bytes"]["gpu_tier_bytes"] <= r["gpu_budget"] for x in r["rounds"])
