"""Automatic precision policy (polykv.hf.precision, issue K): the greedy allocation meets its budget
and is monotone in it, the table survives a round trip, KVCache(preset=...) loads it, and the bytes
KVCache holds are the chosen types' bytes."""

import json

import pytest
import torch

import polykv
from polykv.codecs import get_codec
from polykv.hf.precision import (K_TYPES, V_TYPES, PrecisionTable, layer_bits, layer_weights,
                                 load_precision, measure_sensitivity, precision_path, preset_policy)
from polykv.presets import GATE_CTX, PRESETS, RATIO_MARGIN


def _model(layers=5, head_dim=64, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def _synthetic(layers=7, head_dims=(64,), seed=0) -> PrecisionTable:
    """A table with made-up errors (decreasing with bits, layer sensitivities spread over 100x) over
    the real codecs' bits; head_dims cycle over layers, weights differ per layer."""
    g = torch.Generator().manual_seed(seed)
    from polykv.hf.kv_cache import LayerLayout

    layout = [LayerLayout(i, 1 + i % 3, head_dims[i % len(head_dims)], None) for i in range(layers)]
    sens = (10 ** (2 * torch.rand(layers, 2, generator=g))).tolist()
    k_err = [{"turbo3": s[0], "turbo4": s[0] / 3, "q8_0": s[0] / 300} for s in sens]
    v_err = [{"turbo2": s[1], "turbo3": s[1] / 4, "turbo4": s[1] / 15} for s in sens]
    return PrecisionTable(bits=layer_bits(layout, set(K_TYPES) | set(V_TYPES)),
                          weight=layer_weights(layout, 2048), k_error=k_err, v_error=v_err,
                          meta={"model": "synthetic"})


def _rank(kv):
    """Index of each layer's K and V type among the candidates (cheapest 0)."""
    return [(K_TYPES if side == 0 else V_TYPES).index(t[side]) for t in kv for side in (0, 1)]


@pytest.mark.parametrize("head_dims", [(64,), (64, 128), (32, 256)])
def test_allocation_meets_budget_and_is_monotone(head_dims):
    table = _synthetic(9, head_dims)
    floor = table.min_bits()
    start, seq = table.upgrades()
    top = seq[-1][3]
    step = max(b - a for a, b in zip([floor] + [s[3] for s in seq], [s[3] for s in seq]))
    prev = None
    for b in [floor + (top + 0.5 - floor) * i / 40 for i in range(41)]:
        p = table.allocate(b)
        assert p.bits_achieved <= b + 1e-9
        assert abs(p.bits_achieved - table.average_bits(p.types)) < 1e-12
        if b <= top:  # the budget is used: the next upgrade would not have fitted
            assert p.bits_achieved > b - step - 1e-9, (b, p.bits_achieved)
        if prev is not None:  # a larger budget never makes a layer cheaper, never adds error
            assert all(x >= y for x, y in zip(_rank(p.types), _rank(prev.types)))
            assert p.bits_achieved >= prev.bits_achieved - 1e-12
            assert p.predicted_error <= prev.predicted_error + 1e-12
        prev = p
    assert [t for t in prev.types] == [("q8_0", "turbo4")] * table.layers  # everything bought
    with pytest.raises(ValueError, match="below the cheapest"):
        table.allocate(floor - 0.01)


def test_allocation_buys_the_sensitive_layer_first():
    table = _synthetic(6)
    for e in table.k_error + table.v_error:
        for t in e:
            e[t] *= 1e-3
    table.k_error[4] = {"turbo3": 50.0, "turbo4": 40.0, "q8_0": 0.0}  # one layer's K hurts, a lot
    p = table.allocate(table.min_bits() + 0.5)  # q8_0 K on layer 4 (2 of 12 heads) costs 0.44
    assert p.types[4][0] == "q8_0"
    assert all(kv[0] == "turbo3" for i, kv in enumerate(p.types) if i != 4)


def test_table_round_trip(tmp_path):
    table = _synthetic(5, (64, 128))
    pol = table.add_policy(3.5)
    path = table.save(tmp_path / "t.precision.json")
    back = PrecisionTable.load(path)
    assert back.to_json() == table.to_json()
    assert back.policies["3.5"] == pol
    assert back.allocate(3.9) == table.allocate(3.9)
    bad = json.loads(path.read_text())
    bad["format"] = "something-else"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="polykv-precision"):
        PrecisionTable.load(tmp_path / "bad.json")


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    return tmp_path


def _model_table(model) -> PrecisionTable:
    """Synthetic errors over the model's real layout (so that allocations mix types)."""
    from polykv.hf.kv_cache import model_layout

    from polykv.hf.fingerprint import innerq_key

    lay = model_layout(model)
    t = _synthetic(len(lay))
    t.bits, t.weight = layer_bits(lay, set(K_TYPES) | set(V_TYPES)), layer_weights(lay)
    t.meta["model"] = innerq_key(model)
    return t


def _budget(name, rows=2047):
    """The table budget a preset takes on a model whose layers all hold `rows` rows of head_dim 64 at
    2k (q8_0 ring rows: 8.5 bits): Preset.bits, or for a ratio preset 16 / (ratio x 1.01) minus the
    ring's R x 8.5 / rows, at most Preset.bits."""
    p = PRESETS[name]
    if p.ratio is None:
        return p.bits
    return min(p.bits, 16 / (p.ratio * (1 + RATIO_MARGIN)) - min(p.recent, rows) * 8.5 / rows)


def test_preset_loads_the_table(cache_dir):
    model = _model()
    c = polykv.KVCache(model, preset="balanced")
    assert c.precision["source"] == "fixed" and "polykv calibrate --bits" in c.precision["reason"]
    table = _model_table(model)
    table.save(precision_path(model))
    for name in ("balanced", "max"):
        want = table.allocate(_budget(name)).types
        assert len(set(want)) > 1  # a real mix, not one pair everywhere
        c = polykv.KVCache(model, preset=name)
        assert c.precision["source"] == "calibrated"
        assert c.precision["bits_target"] == round(_budget(name), 4)
        assert [(lay.k_type, lay.v_type) for lay in c.layers] == list(want)
        for kw in (dict(precision=None), dict(k="turbo4"), dict(v="turbo4")):
            c = polykv.KVCache(model, preset=name, **kw)
            assert c.precision["source"] == "fixed", kw
            assert len({(lay.k_type, lay.v_type) for lay in c.layers}) == 1
    # explicit overrides still win over the table
    c = polykv.KVCache(model, preset="max", overrides={0: ("f16", "f16")})
    assert (c.layers[0].k_type, c.layers[0].v_type) == ("f16", "f16")
    assert polykv.KVCache(model, preset="default").precision["source"] == "fixed"


def test_table_of_another_model_is_refused(cache_dir):
    model = _model()
    table = _model_table(model)
    table.meta["model"] = "llama-0000000000000000"
    table.save(precision_path(model))
    with pytest.raises(ValueError, match="measured on"):
        load_precision(model)


@pytest.mark.parametrize("name", ["balanced", "max"])
def test_held_bytes_match_chosen_types(cache_dir, name):
    """After a prompt, the bytes KVCache holds are exactly the chosen types' packed bytes per layer
    plus the preset's recent ring (R q8_0 rows of K and V), the measured bits/value is the table's
    prediction plus the ring's share, and the preset's byte gate vs f16 holds at 2k."""
    model = _model(layers=6, head_dim=64)
    table = _model_table(model)
    table.save(precision_path(model))
    n = 2047
    ids = torch.randint(3, 120, (1, n))
    caches = {}
    with torch.no_grad():
        for key, kw in (("f16", dict(k="f16", v="f16")), (name, dict(preset=name))):
            caches[key] = polykv.KVCache(model, **kw)
            model(ids, past_key_values=caches[key], use_cache=True)
            caches[key].compact()
    c = caches[name]
    assert c.precision["source"] == "calibrated"
    types = table.allocate(_budget(name)).types
    R, rings, values = PRESETS[name].recent, 0, 0
    assert R > 0
    for lay, (k, v) in zip(c.layers, types):
        h, d = lay.layout.num_kv_heads, lay.layout.head_dim
        want = sum(p.nbytes() for p in (get_codec(k, d).empty((1, h, n)), get_codec(v, d).empty((1, h, n))))
        ring = 2 * get_codec("q8_0", d).empty((1, h, R)).nbytes()
        assert lay.nbytes() == want + ring, (lay.layout.index, k, v)
        rings += ring
        values += 2 * h * n * d
    report = c.memory_report()
    assert report["precision"]["source"] == "calibrated"
    assert abs(report["bits_per_value"] - table.average_bits(types) - rings * 8 / values) < 1e-9
    gate = {"balanced": 3.5, "max": 5.0}[name]
    assert caches["f16"].nbytes() / c.nbytes() >= gate


# --- a ratio preset pays for its ring from the table, per model (docs/quality.md, session 12) ------

def _gemma(window=256, head_dim=64):
    """A random Gemma-3 (two sliding layers of `window`, one full): ring rows weigh more there."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                           sliding_window=window, max_position_embeddings=4096,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


def test_ring_bits_of_the_gate_models():
    """The ring's share at 2k from the two models' shapes (no weights): SmolLM2 R x 8.5 / 2,047,
    Gemma-3 18 x R rows over 15 x 511 + 3 x 2,047 (docs/quality.md: 0.266 / 0.709 at R = 64)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    from polykv.hf.kv_cache import model_layout
    from polykv.hf.precision import ratio_budget, ring_bits

    smol = model_layout(LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                    hidden_size=576, head_dim=64))
    gemma = model_layout(Gemma3TextConfig(num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                          head_dim=256, hidden_size=640, sliding_window=512))
    for R in (8, 32, 64):
        assert ring_bits(smol, R) == pytest.approx(R * 8.5 / 2047, rel=1e-12)
        assert ring_bits(gemma, R) == pytest.approx(18 * R * 8.5 / (15 * 511 + 3 * 2047), rel=1e-12)
    assert ring_bits(smol, 0) == 0.0
    assert ring_bits(gemma, 600) == pytest.approx((15 * 511 + 3 * 600) * 8.5 / (15 * 511 + 3 * 2047))
    assert ratio_budget(gemma, 3.5, 64) == pytest.approx(16 / (3.5 * 1.01) - 0.70926, abs=1e-5)


@pytest.mark.parametrize("kind,ratio,R", [("llama", 3.5, 64), ("llama", 5.0, 32), ("gemma", 3.5, 64),
                                          ("gemma", 3.5, 100), ("gemma", 4.0, 32)])
def test_ratio_budget_meets_the_ratio_on_held_bytes(cache_dir, monkeypatch, kind, ratio, R):
    """A preset defined by its ratio (no bits cap): after a 2,047-token prompt the held bytes, measured
    from the tensors, are >= ratio fewer than f16's, ring included — on a model whose sliding layers
    make the ring weigh more too — and they are the ratio info announced."""
    import dataclasses

    from polykv.presets import PRESETS as presets

    model = _model(layers=4, head_dim=64) if kind == "llama" else _gemma()
    monkeypatch.setitem(presets, "balanced", dataclasses.replace(presets["balanced"], bits=None, ratio=ratio,
                                                                 recent=R))
    table = _model_table(model)
    table.save(precision_path(model))
    ids = torch.randint(3, 120, (1, GATE_CTX - 1))
    caches = {}
    with torch.no_grad():
        for key, kw in (("f16", dict(k="f16", v="f16")), ("p", dict(preset="balanced"))):
            caches[key] = polykv.KVCache(model, **kw)
            model(ids, past_key_values=caches[key], use_cache=True)
            caches[key].compact()
    c, info = caches["p"], caches["p"].precision
    assert info["source"] == "calibrated" and info["ratio_target"] == ratio and info["bits_cap"] is None
    assert info["ring"]["rows"] == R and c.recent == R
    held = caches["f16"].nbytes() / c.nbytes()
    assert held >= ratio, (kind, ratio, R, held, info)
    assert held == pytest.approx(info["ratio_expected"], rel=1e-4)
    # the ring's measured share is what the budget paid for
    ring = sum(lay.ring.nbytes() for lay in c.layers)
    values = sum(2 * lay.layout.num_kv_heads * lay.layout.head_dim * lay.store.length for lay in c.layers)
    assert info["ring"]["bits"] == pytest.approx(ring * 8 / values, abs=1e-4)
    # the budget is the whole ratio less the ring's measured share: no more (the ratio holds), no less
    assert info["bits_target"] == pytest.approx(16 / (ratio * (1 + RATIO_MARGIN)) - ring * 8 / values, abs=1e-4)
    assert info["bits_target"] > table.min_bits()
    if kind == "gemma":  # the ring costs this model more than a full-length one: the table pays
        assert info["bits_target"] < 16 / (ratio * (1 + RATIO_MARGIN)) - R * 8.5 / 2047 - 0.05


def test_ratio_preset_info_and_what_it_leaves_alone(cache_dir):
    """balanced reports the ring-adjusted budget (capped at its bits); an explicit ring R moves it;
    a bits-only preset (max), explicit k= / v=, precision=None and overrides are unaffected."""
    from polykv.hf.precision import preset_policy

    model = _model(layers=6, head_dim=64)
    table = _model_table(model)
    table.save(precision_path(model))
    p = PRESETS["balanced"]
    assert p.ratio is not None and p.bits is not None and p.recent > 0
    info = polykv.KVCache(model, preset="balanced").precision
    ring = p.recent * 8.5 / 2047
    assert info["ring"] == {"rows": p.recent, "bits": round(ring, 4), "ctx": GATE_CTX}
    assert info["bits_target"] == round(min(p.bits, 16 / (p.ratio * (1 + RATIO_MARGIN)) - ring), 4)
    assert info["ratio_expected"] == pytest.approx(16 / (info["bits_achieved"] + ring), abs=2e-4)
    assert info["ratio_expected"] >= p.ratio
    # a ring that costs more than the cap leaves: the table pays for it
    _, big = preset_policy(model, "balanced", table, recent=400)
    assert big["ring"]["rows"] == 400
    assert big["bits_target"] == round(16 / (p.ratio * (1 + RATIO_MARGIN)) - 400 * 8.5 / 2047, 4)
    assert big["bits_target"] < p.bits and big["ratio_expected"] >= p.ratio
    _, none = preset_policy(model, "balanced", table, recent=0)
    assert none["bits_target"] == p.bits and none["ring"]["bits"] == 0.0
    # KVCache's own recent= is the ring the budget pays for (not the preset's R)
    own = polykv.KVCache(model, preset="balanced", recent=400)
    assert own.recent == 400 and own.precision["ring"] == big["ring"]
    assert own.precision["bits_target"] == big["bits_target"]
    # a bits-only preset: its budget, no ring accounting
    m = polykv.KVCache(model, preset="max").precision
    assert PRESETS["max"].ratio is None
    assert m["bits_target"] == PRESETS["max"].bits and "ring" not in m and "ratio_target" not in m
    assert [tuple(t) for t in m["types"]] == list(table.allocate(PRESETS["max"].bits).types)
    # explicit types, no table, overrides: as before
    for kw in (dict(k="turbo4"), dict(v="q8_0"), dict(precision=None)):
        assert polykv.KVCache(model, preset="balanced", **kw).precision["source"] == "fixed"
    c = polykv.KVCache(model, preset="balanced", overrides={2: ("q8_0", "q8_0")})
    assert (c.layers[2].k_type, c.layers[2].v_type) == ("q8_0", "q8_0")
    assert c.precision["bits_target"] == info["bits_target"]


def test_measure_sensitivity_tiny_model():
    """Real measurement on a random model: an error for every (layer, type), q8_0 keys the closest."""
    model = _model(layers=3)
    ids = torch.randint(3, 120, (160,)).tolist()
    table = measure_sensitivity(model, None, ids=ids, prefix=128)
    assert table.layers == 3 and table.meta["prefix"] == 128 and table.meta["tokens"] == 160
    for i in range(3):
        assert set(table.k_error[i]) == set(K_TYPES) and set(table.v_error[i]) == set(V_TYPES)
        assert all(e >= 0 and e == e for e in (*table.k_error[i].values(), *table.v_error[i].values()))
    assert sum(e["q8_0"] for e in table.k_error) < sum(e["turbo3"] for e in table.k_error)
    assert sum(e["turbo4"] for e in table.v_error) < sum(e["turbo2"] for e in table.v_error)
    p = table.allocate(4.0)
    assert p.bits_achieved <= 4.0
    overrides, info = preset_policy(model, "balanced", table)
    assert info["source"] == "calibrated" and len(overrides) == 3


def test_average_bits_is_the_stored_bits_per_value():
    """The budget's average = bytes x 8 / values of real packed storage at ctx tokens, layers of
    different heads / head_dim / sliding window (ctx - 1 rows; a sliding layer window - 1)."""
    from polykv.hf.kv_cache import LayerLayout

    layout = [LayerLayout(0, 1, 64, None), LayerLayout(1, 3, 128, 512), LayerLayout(2, 2, 32, None),
              LayerLayout(3, 4, 256, 1024)]
    ctx = 2048
    table = PrecisionTable(bits=layer_bits(layout, set(K_TYPES) | set(V_TYPES)), weight=layer_weights(layout, ctx),
                           k_error=[{}] * 4, v_error=[{}] * 4)
    types = [("q8_0", "turbo2"), ("turbo3", "turbo4"), ("turbo4", "turbo3"), ("q8_0", "turbo4")]
    nbytes = values = 0
    for lay, (k, v) in zip(layout, types):
        rows = ctx - 1 if lay.sliding_window is None else lay.sliding_window - 1
        for t in (k, v):
            nbytes += get_codec(t, lay.head_dim).empty((1, lay.num_kv_heads, rows)).nbytes()
            values += lay.num_kv_heads * rows * lay.head_dim
    assert abs(table.average_bits(types) - nbytes * 8 / values) < 1e-12


# --- the copying signal (issue K: calibrated presets lost random codes that f16 copied) -------------

def _tok():
    from transformers import AutoTokenizer

    from polykv.hf.loading import REGISTRY, _ensure_registry_cache

    return AutoTokenizer.from_pretrained(_ensure_registry_cache(REGISTRY["smollm2-135m"]))


def test_copy_examples_are_not_the_evaluated_codes():
    """Needle prompts from another make_codes seed than the evaluated set, technical prose only, every
    code kind, the teacher-forced tail = the exact code and '.'."""
    from polykv.data.make_codes import KINDS, SEED, make
    from polykv.hf.precision import COPY_SEED, copy_examples

    tok = _tok()
    ex = copy_examples(tok, len(KINDS) + 2)
    evaluated = {r["needle"] for r in make(SEED)}
    ours = [r for r in make(COPY_SEED, ctxs=(1024,), per_ctx=3 * (len(KINDS) + 2) + 3 * len(KINDS))
            if r["genre"] == "tech"]
    tails = [tok.decode(ids[p:]) for ids, p in ex]
    assert len(ex) == len(KINDS) + 2
    for (ids, p), tail in zip(ex, tails):
        code = tail.strip().removesuffix(".")
        assert tail == " " + code + "." and code not in evaluated
        r = next(r for r in ours if r["needle"] == code)
        assert r["genre"] == "tech" and r["needle"] in tok.decode(ids[:p])  # the code is in the prompt
        assert tok.decode(ids[:p]).rstrip().endswith(r["prefix"])
    kinds = [next(r["kind"] for r in ours if r["needle"] == t.strip()[:-1]) for t in tails]
    assert set(kinds[:len(KINDS)]) == set(KINDS)
    with pytest.raises(ValueError, match="evaluated code set"):
        copy_examples(tok, 2, seed=SEED)


def test_combine_errors_weights_and_units():
    """Each signal is scaled by its all-cheapest total (its units do not matter), weights mix them,
    the result stays in the novel signal's units: weight 0 = the novel errors exactly."""
    from polykv.hf.precision import combine_errors

    t = _synthetic(5)
    novel = {"k_error": t.k_error, "v_error": t.v_error}
    copy = _synthetic(5, seed=3)
    copy_sig = {"k_error": copy.k_error, "v_error": copy.v_error}
    scaled = {"k_error": [{k: 1e3 * e for k, e in d.items()} for d in copy.k_error],
              "v_error": [{k: 1e3 * e for k, e in d.items()} for d in copy.v_error]}
    args = (t.bits, K_TYPES, V_TYPES)
    k0, v0 = combine_errors(t.bits, {"novel": novel, "copy": copy_sig}, {"novel": 1.0, "copy": 0.0}, K_TYPES, V_TYPES)
    assert all(abs(k0[i][x] - t.k_error[i][x]) <= 1e-12 * t.k_error[i][x] for i in range(5) for x in K_TYPES)
    a = combine_errors(t.bits, {"novel": novel, "copy": copy_sig}, {"novel": 0.5, "copy": 0.5}, *args[1:])
    b = combine_errors(t.bits, {"novel": novel, "copy": scaled}, {"novel": 0.5, "copy": 0.5}, *args[1:])
    assert all(abs(a[0][i][x] - b[0][i][x]) <= 1e-9 * a[0][i][x] for i in range(5) for x in K_TYPES)
    total = lambda k, v: sum(k[i]["turbo3"] + v[i]["turbo2"] for i in range(5))  # noqa: E731
    # half and half: the all-cheapest allocation's combined error = the novel total
    assert abs(total(*a) - total(t.k_error, t.v_error)) < 1e-9 * total(t.k_error, t.v_error)
    with pytest.raises(ValueError, match="positive weight"):
        combine_errors(t.bits, {"novel": novel}, {"novel": 0.0}, *args[1:])


def test_copy_signal_moves_the_allocation():
    """A layer that only the copying signal flags gets its K bought once the copy signal has weight."""
    from polykv.hf.precision import combine_errors

    t = _synthetic(6)
    copy_k = [{"turbo3": 1e-3, "turbo4": 5e-4, "q8_0": 0.0} for _ in range(6)]
    copy_k[2] = {"turbo3": 50.0, "turbo4": 30.0, "q8_0": 0.0}
    copy_v = [{"turbo2": 1e-3, "turbo3": 5e-4, "turbo4": 1e-4} for _ in range(6)]
    t.meta["signals"] = {"novel": {"k_error": t.k_error, "v_error": t.v_error},
                         "copy": {"k_error": copy_k, "v_error": copy_v}}
    budget = t.min_bits() + 1.0  # q8_0 K on layer 2 (3 of 12 heads) costs 0.66
    assert t.reweigh(0.0).allocate(budget) == t.allocate(budget)  # weight 0: the novel-only table
    assert t.allocate(budget).types[2][0] != "q8_0"
    assert t.reweigh(0.5).allocate(budget).types[2][0] == "q8_0"
    k, v = combine_errors(t.bits, t.meta["signals"], {"novel": 0.5, "copy": 0.5}, K_TYPES, V_TYPES)
    assert t.reweigh(0.5).k_error == k and t.reweigh(0.5).v_error == v
    with pytest.raises(ValueError, match="no copying signal"):
        _synthetic(3).reweigh(0.5)


def test_measure_copy_signal_tiny_model(tmp_path):
    """Real measurement with the copying signal on a random model: both signals kept per layer and
    type, the table's errors are their combination, the scored positions are the copied tails', and
    the table round-trips (reweigh works on the loaded table)."""
    from polykv.hf.precision import combine_errors

    model = _model(layers=3)
    ids = torch.randint(3, 120, (160,)).tolist()
    g = torch.Generator().manual_seed(1)
    copy = []
    for n, tail in ((90, 7), (70, 12)):
        x = torch.randint(3, 120, (n,), generator=g).tolist()
        copy.append((x + x[20:20 + tail], n))  # the tail repeats a span of the prompt: a copy
    table = measure_sensitivity(model, None, ids=ids, prefix=128, copy_weight=0.25, copy=copy)
    sig = table.meta["signals"]
    assert sig["copy"]["scored"] == 19 and sig["copy"]["prompts"] == 2
    assert table.meta["weights"] == {"novel": 0.75, "copy": 0.25}
    for s in ("novel", "copy"):
        for side, types in (("k_error", K_TYPES), ("v_error", V_TYPES)):
            assert all(set(e) == set(types) and all(x >= 0 for x in e.values()) for e in sig[s][side])
    assert sig["copy"]["k_error"] != sig["novel"]["k_error"]
    assert sum(e["turbo4"] for e in sig["copy"]["v_error"]) < sum(e["turbo2"] for e in sig["copy"]["v_error"])
    k, v = combine_errors(table.bits, sig, table.meta["weights"], K_TYPES, V_TYPES)
    assert (table.k_error, table.v_error) == (k, v)
    plain = measure_sensitivity(model, None, ids=ids, prefix=128)  # same novel signal without the copy
    assert plain.k_error == sig["novel"]["k_error"] and "signals" not in plain.meta
    back = PrecisionTable.load(table.save(tmp_path / "t.precision.json"))
    assert back.to_json() == table.to_json()
    assert back.reweigh(0.0).allocate(3.6) == plain.allocate(3.6)
    with pytest.raises(ValueError, match="copy_weight"):
        measure_sensitivity(model, None, ids=ids, prefix=128, copy_weight=1.5, copy=copy)
