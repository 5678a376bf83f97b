"""Pool persistence (polykv/pool/persist.py): round trips, versioned store layout, every manifest
field and every file corrupted (refused with PoolFormatError, never another error), stray files
ignored and cleaned, saves interrupted half-way (raised inside, or the process killed) leave the
previous save loadable."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from polykv.pool import PoolFormatError, SharedKVPool
from polykv.pool import persist
from polykv.pool.persist import MANIFEST, TENSORS, has_saved_pool, manifest_sha256

from .conftest import CharTok, tiny_llama

DOC = list(range(3, 60)) + list(range(10, 40))  # 87 tokens
DOC2 = list(range(90, 20, -1))  # 70 tokens, evicted in the template (ids only)
PROMPTS = [[5, 6, 7], [8, 9]]
ROOT = Path(__file__).resolve().parents[2]


# --- helpers -------------------------------------------------------------------------------------

def gen_dirs(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir() if persist.GENERATION.fullmatch(p.name))


def current(store: Path) -> Path:
    return gen_dirs(store)[-1]


def read_manifest(store: Path) -> dict:
    return json.loads((current(store) / MANIFEST).read_text())


def write_manifest(store: Path, m: dict, reseal: bool = True) -> None:
    if reseal:
        m["manifest_sha256"] = manifest_sha256(m)
    (current(store) / MANIFEST).write_text(json.dumps(m, indent=2))


def edit_manifest(store: Path, fn) -> None:
    """Apply fn to the manifest and re-seal it (manifest_sha256), so that the field checks behind the
    checksum are what the test exercises."""
    m = read_manifest(store)
    fn(m)
    write_manifest(store, m)


def edit_tensors(store: Path, fn, metadata=None) -> None:
    """Rewrite pool.safetensors through fn(tensors, manifest) and keep the manifest consistent with
    the new file (bytes, sha256, seal): the tensor checks are what the test exercises."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = current(store) / TENSORS
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        data = {k: f.get_tensor(k) for k in f.keys()}
    m = read_manifest(store)
    fn(data, m)
    save_file(data, str(path), metadata=meta if metadata is None else metadata)
    refile(store, m)


def refile(store: Path, m: dict | None = None) -> None:
    m = read_manifest(store) if m is None else m
    path = current(store) / TENSORS
    m["files"][TENSORS] = {"bytes": path.stat().st_size, "sha256": persist._file_sha256(path)}
    write_manifest(store, m)


@pytest.fixture(scope="module")
def model_tok():
    return tiny_llama(), CharTok()


@pytest.fixture(scope="module")
def innerq_table():
    from polykv.codecs import InnerQTable

    torch.manual_seed(3)
    return InnerQTable(scales={i: (torch.rand(2, 32) + 0.5) for i in range(2)})


@pytest.fixture(scope="module")
def template(model_tok, innerq_table, tmp_path_factory):
    """A saved store with every kind of tensor: a resident turbo4-K (codes + norms, InnerQ) /
    q8_0-V (codes + scales) document and an evicted one (ids only). Returns (store, answers)."""
    model, tok = model_tok
    pool = SharedKVPool(model, tok, k="turbo4", v="q8_0", innerq=innerq_table, prefill_chunk=32)
    doc = pool.add_document(DOC, name="d")
    gone = pool.add_document(DOC2)
    pool.evict(gone)
    answers = pool.generate(doc, PROMPTS, max_new_tokens=5)
    store = tmp_path_factory.mktemp("tpl") / "store"
    pool.save(store)
    return store, answers


@pytest.fixture
def store(template, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(template[0], dst)
    return dst


def load(store, model_tok):
    return SharedKVPool.load(store, *model_tok)


# --- round trips and layout ----------------------------------------------------------------------

def test_roundtrip_same_answers_bytes_and_layout(store, template, model_tok, innerq_table):
    pool = load(store, model_tok)
    docs = {d["id"]: d for d in pool.documents()}
    assert len(docs) == 2
    resident = [d for d in docs.values() if d["resident"]]
    assert [(d["name"], d["tokens"]) for d in resident] == [("d", len(DOC))]
    torch.testing.assert_close(pool.innerq.layer(1), innerq_table.layer(1), atol=0, rtol=0)
    assert pool.generate(resident[0]["id"], PROMPTS, max_new_tokens=5) == template[1]
    # the evicted document kept its ids: it re-prefills exactly
    evicted = next(d["id"] for d in docs.values() if not d["resident"])
    with pytest.warns(UserWarning, match="evicted; re-prefilling"):
        pool.generate(evicted, [[5]], max_new_tokens=1)
    assert pool._docs[evicted].ids == DOC2
    # layout: one generation directory, nothing else; a second save replaces it by the next one
    assert [p.name for p in store.iterdir()] == ["pool-00000001"]
    assert sorted(p.name for p in (store / "pool-00000001").iterdir()) == [MANIFEST, TENSORS]
    pool.save(store)
    assert [p.name for p in store.iterdir()] == ["pool-00000002"]
    assert load(store, model_tok).documents() == pool.documents()


def test_f16_and_sliding_window_roundtrip(tmp_path):
    """Raw codecs (no scales tensors) and Gemma-3-style sliding layers (rows < tokens,
    prefix_start > 0) round-trip to the same logits; a wrong sliding prefix_start is refused."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model, tok = Gemma3ForCausalLM(cfg).eval(), CharTok()
    pool = SharedKVPool(model, tok, k="f16", v="f16", prefill_chunk=8)
    doc = pool.add_document(list(range(3, 33)))
    pool.save(tmp_path / "s")
    m = read_manifest(tmp_path / "s")
    assert m["documents"][0]["rows"] == [7, 7, 30] and m["documents"][0]["prefix_start"] == [23, 23, 0]
    outs = []
    for p in (pool, SharedKVPool.load(tmp_path / "s", model, tok)):
        with p.open_batch(doc) as b:
            a = b.add([40, 41])
            outs.append(b.step()[a])
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    for field, li, value, match in (("prefix_start", 0, 22, r"prefix_start\[0\]"),
                                    ("rows", 1, 9, r"rows\[1\]"),  # more than the window
                                    ("rows", 2, 29, r"rows\[2\]")):  # a full layer keeps every row
        edit_manifest(tmp_path / "s", lambda m: m["documents"][0][field].__setitem__(li, value))
        with pytest.raises(PoolFormatError, match=match):
            SharedKVPool.load(tmp_path / "s", model, tok)
        pool.save(tmp_path / "s")


def test_empty_pool_and_balanced_innerq_roundtrip(model_tok, tmp_path):
    """No documents (the placeholder tensor), and an InnerQ table with no scaled layer (every layer
    balanced): both load back (the second used to be refused: its hash had no tensors to match)."""
    from polykv.codecs import InnerQTable

    model, tok = model_tok
    SharedKVPool(model, tok).save(tmp_path / "e")
    assert load(tmp_path / "e", model_tok).documents() == []
    pool = SharedKVPool(model, tok, k="turbo3", v="turbo3", innerq=InnerQTable(scales={}))
    pool.add_document(DOC[:20])
    pool.save(tmp_path / "b")
    back = load(tmp_path / "b", model_tok)
    assert back.innerq is not None and back.innerq.scales == {}
    assert back.documents()[0]["bytes"] == pool.documents()[0]["bytes"]


# --- model / tokenizer fingerprints --------------------------------------------------------------

def test_fingerprint_covers_every_tensor(store, model_tok):
    """One value of any tensor changed (here: the last one of a layer in the middle, which a sampled
    fingerprint does not read) refuses the load; restoring it loads again."""
    from polykv.hf.loading import model_fingerprint

    model, tok = model_tok
    before = model_fingerprint(model)
    assert model_fingerprint(tiny_llama()) == before  # same weights, another object: same fingerprint
    for name, p in model.named_parameters():
        old = p.detach().reshape(-1)[-1].clone()
        with torch.no_grad():
            p.reshape(-1)[-1] += 1e-3
        try:
            assert model_fingerprint(model) != before, name
        finally:
            with torch.no_grad():
                p.reshape(-1)[-1] = old
        assert model_fingerprint(model) == before, name
    w = model.model.layers[1].self_attn.o_proj.weight
    with torch.no_grad():
        w[-1, -1] += 1e-3
    try:
        with pytest.raises(PoolFormatError, match="different model"):
            load(store, model_tok)
    finally:
        with torch.no_grad():
            w[-1, -1] -= 1e-3
    assert model_fingerprint(model) == before
    with pytest.raises(PoolFormatError, match="different model"):
        SharedKVPool.load(store, tiny_llama(seed=1), tok)
    with pytest.raises(PoolFormatError, match="different model"):
        SharedKVPool.load(store, tiny_llama().to(torch.bfloat16), tok)


def test_different_tokenizer_refused(store, model_tok):
    class OtherTok(CharTok):
        def get_vocab(self):
            return {chr(i): i + 1 for i in range(128)}

    with pytest.raises(PoolFormatError, match="different tokenizer"):
        SharedKVPool.load(store, model_tok[0], OtherTok())


# --- every manifest field ------------------------------------------------------------------------

def _set(path, value):
    def fn(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return fn


def _delete(path):
    def fn(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return fn


def _doc0_consistent_ids(m):
    """Change document 0's ids_sha256 and id together: only the tensor check can catch it."""
    h = "f" * 64
    m["documents"][0]["ids_sha256"], m["documents"][0]["id"] = h, "doc-" + h[:16]


def _dup_doc(m):
    m["documents"][1] = dict(m["documents"][0], index=1)


def _swap_docs(m):
    m["documents"].reverse()


D0, D1, F = ("documents", 0), ("documents", 1), ("files", TENSORS)
MANIFEST_CASES = [
    # top level
    ("missing field", _delete(("codec",)), "fields missing"),
    ("unknown field", _set(("extra",), 1), "unexpected"),
    ("format", _set(("format",), "other"), "format is 'other'"),
    ("version 1", _set(("version",), 1), "version 1"),
    ("version string", _set(("version",), "2"), "version '2'"),
    ("version bool", _set(("version",), True), "version True"),
    ("model_fingerprint type", _set(("model_fingerprint",), 12), "model_fingerprint"),
    ("model_fingerprint hex", _set(("model_fingerprint",), "Z" * 64), "model_fingerprint"),
    ("model_fingerprint other", _set(("model_fingerprint",), "0" * 64), "different model"),
    ("tokenizer_fingerprint short", _set(("tokenizer_fingerprint",), "abc"), "tokenizer_fingerprint"),
    ("tokenizer_fingerprint other", _set(("tokenizer_fingerprint",), "0" * 64), "different tokenizer"),
    # codec
    ("codec not an object", _set(("codec",), "turbo4"), "codec: must be a JSON object"),
    ("codec.k unknown", _set(("codec", "k"), "q5_k"), "codec.k"),
    ("codec.k null", _set(("codec", "k"), None), "codec.k"),
    ("codec.v number", _set(("codec", "v"), 3), "codec.v"),
    ("codec.k not turbo with InnerQ", _set(("codec", "k"), "q8_0"), "codec.innerq_sha256"),
    ("codec.v other type", _set(("codec", "v"), "q4_0"), "expected torch.uint8"),
    ("codec.k other turbo", _set(("codec", "k"), "turbo3"), "expected torch.uint8"),
    ("codec.innerq_sha256 null", _set(("codec", "innerq_sha256"), None), "unexpected tensor 'innerq"),
    ("codec.innerq_sha256 other", _set(("codec", "innerq_sha256"), "0" * 64), "InnerQ table does not match"),
    ("codec.innerq_sha256 type", _set(("codec", "innerq_sha256"), 7), "innerq_sha256"),
    ("codec extra field", _set(("codec", "innerq"), "auto"), "codec: fields"),
    # files
    ("files empty", _set(("files",), {}), "files: fields missing"),
    ("files.bytes negative", _set(F + ("bytes",), -1), "bytes: must be an integer"),
    ("files.bytes string", _set(F + ("bytes",), "100"), "bytes: must be an integer"),
    ("files.bytes off by one", lambda m: m["files"][TENSORS].__setitem__("bytes", m["files"][TENSORS]["bytes"] + 1),
     "truncated or replaced"),
    ("files.sha256 other", _set(F + ("sha256",), "0" * 64), "sha256 does not match"),
    ("files.sha256 type", _set(F + ("sha256",), None), "sha256"),
    # documents
    ("documents object", _set(("documents",), {}), "documents: must be a list"),
    ("documents empty", _set(("documents",), []), "unexpected tensors"),
    ("documents swapped", _swap_docs, r"documents\[0\].index"),
    ("document not an object", _set(D0, "doc"), r"documents\[0\]: must be a JSON object"),
    ("document missing field", _delete(D0 + ("tail",)), r"documents\[0\]: fields missing \['tail'\]"),
    ("document unknown field", _set(D0 + ("layers",), []), r"unexpected \['layers'\]"),
    ("index", _set(D0 + ("index",), 1), r"documents\[0\].index"),
    ("index string", _set(D0 + ("index",), "0"), r"documents\[0\].index"),
    ("id", _set(D0 + ("id",), "doc-0000000000000000"), r"documents\[0\].id"),
    ("id duplicate", _dup_doc, r"documents\[1\].id: duplicate"),
    ("ids_sha256 alone", _set(D0 + ("ids_sha256",), "0" * 64), r"documents\[0\].id"),
    ("ids_sha256 with id", _doc0_consistent_ids, "do not match ids_sha256"),
    ("name number", _set(D0 + ("name",), 5), r"documents\[0\].name"),
    ("tokens zero", _set(D0 + ("tokens",), 0), r"documents\[0\].tokens"),
    ("tokens negative", _set(D0 + ("tokens",), -3), r"documents\[0\].tokens"),
    ("tokens float", _set(D0 + ("tokens",), 87.0), r"documents\[0\].tokens"),
    ("tokens one more", _set(D0 + ("tokens",), len(DOC) + 1), r"documents\[0\].rows\[0\]"),
    ("tokens evicted one more", _set(D1 + ("tokens",), len(DOC2) + 1), "expected torch.int64"),
    ("chat string", _set(D0 + ("chat",), "yes"), r"documents\[0\].chat"),
    ("chat null", _set(D0 + ("chat",), None), r"documents\[0\].chat"),
    ("tail null", _set(D0 + ("tail",), None), r"documents\[0\].tail"),
    ("tail number", _set(D0 + ("tail",), 5), r"documents\[0\].tail"),
    ("resident string", _set(D0 + ("resident",), "true"), r"documents\[0\].resident"),
    ("resident false, rows kept", _set(D0 + ("resident",), False), r"documents\[0\].prefix_start: must be null"),
    ("evicted made resident", _set(D1 + ("resident",), True), r"documents\[1\].prefix_start: must be a list"),
    ("naive_f16_bytes negative", _set(D0 + ("naive_f16_bytes",), -1), "naive_f16_bytes"),
    ("naive_f16_bytes float", _set(D0 + ("naive_f16_bytes",), 1.5), "naive_f16_bytes"),
    ("prefix_start null", _set(D0 + ("prefix_start",), None), r"documents\[0\].prefix_start"),
    ("prefix_start short", _set(D0 + ("prefix_start",), [0]), r"documents\[0\].prefix_start"),
    ("prefix_start value", lambda m: m["documents"][0]["prefix_start"].__setitem__(1, 1), r"prefix_start\[1\]"),
    ("rows long", lambda m: m["documents"][0]["rows"].append(87), r"documents\[0\].rows"),
    ("rows value", lambda m: m["documents"][0]["rows"].__setitem__(0, 86), r"rows\[0\]"),
    ("rows huge", lambda m: m["documents"][0]["rows"].__setitem__(1, 10 ** 12), r"rows\[1\]"),
    ("rows string", lambda m: m["documents"][0]["rows"].__setitem__(1, "87"), r"rows\[1\]"),
]


@pytest.mark.parametrize("name,mutate,match", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_manifest_field_corrupted_is_refused(store, model_tok, name, mutate, match):
    edit_manifest(store, mutate)
    with pytest.raises(PoolFormatError, match=match):
        load(store, model_tok)


def test_manifest_cases_cover_every_field(template):
    """The table above touches every field the manifest has."""
    m = json.loads((current(template[0]) / MANIFEST).read_text())
    touched = set()
    for _, fn, _ in MANIFEST_CASES:
        after = copy.deepcopy(m)
        fn(after)
        for key in set(m) | set(after):
            if m.get(key) != after.get(key):
                touched.add(key)
        for kind in ("codec", "files"):
            a = after.get(kind) if isinstance(after.get(kind), dict) else {}
            touched |= {f"{kind}.{k}" for k in m[kind] if m[kind].get(k) != a.get(k)}
        for i, d in enumerate(m["documents"]):
            a = after.get("documents")
            if isinstance(a, list) and i < len(a) and isinstance(a[i], dict):
                touched |= {f"documents.{k}" for k in d if a[i].get(k) != d[k]}
    want = set(m) - {"manifest_sha256"} | {f"codec.{k}" for k in m["codec"]} | {"files.pool.safetensors"} \
        | {f"documents.{k}" for k in m["documents"][0]}
    assert want <= touched, want - touched


def test_manifest_edit_without_reseal_is_refused(store, model_tok):
    """Any edit (here a name, which no other check covers) breaks manifest_sha256."""
    m = read_manifest(store)
    m["documents"][0]["name"] = "e"
    write_manifest(store, m, reseal=False)
    with pytest.raises(PoolFormatError, match="manifest_sha256"):
        load(store, model_tok)


def test_manifest_every_byte_flipped_is_refused(store, model_tok):
    path = current(store) / MANIFEST
    raw = path.read_bytes()
    for i in range(len(raw)):
        for mask in (0x01, 0x80):
            b = bytearray(raw)
            b[i] ^= mask
            path.write_bytes(bytes(b))
            with pytest.raises(PoolFormatError):
                load(store, model_tok)
    path.write_bytes(raw)
    load(store, model_tok)


@pytest.mark.parametrize("content", [b"", b"[]", b"null", b"{", b"[" * 100000, b"\xff\xfe{}"])
def test_manifest_not_an_object(store, model_tok, content):
    (current(store) / MANIFEST).write_bytes(content)
    with pytest.raises(PoolFormatError, match=MANIFEST):
        load(store, model_tok)


def test_manifest_truncated_is_refused(store, model_tok):
    path = current(store) / MANIFEST
    raw = path.read_bytes()
    for n in list(range(0, len(raw), 37)) + [len(raw) - 2]:
        path.write_bytes(raw[:n])
        with pytest.raises(PoolFormatError):
            load(store, model_tok)


# --- every file ----------------------------------------------------------------------------------

def test_tensor_file_truncated_flipped_or_grown(store, model_tok):
    path = current(store) / TENSORS
    raw = path.read_bytes()
    n = len(raw)
    for cut in (0, 1, 8, 100, n // 2, n - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(PoolFormatError, match="truncated"):
            load(store, model_tok)
    path.write_bytes(raw + b"\0")
    with pytest.raises(PoolFormatError, match="truncated or replaced"):
        load(store, model_tok)
    header = int.from_bytes(raw[:8], "little") + 8
    positions = sorted(set(list(range(0, min(header, 64))) + list(range(0, n, max(1, n // 150))) + [header, n - 1]))
    for i in positions:
        b = bytearray(raw)
        b[i] ^= 0x01
        path.write_bytes(bytes(b))
        with pytest.raises(PoolFormatError, match="corrupted"):
            load(store, model_tok)
    path.write_bytes(raw)
    load(store, model_tok)


def _drop(name):
    return lambda data, m: data.pop(name)


def _ids_out_of_vocab(data, m):
    from polykv.pool.pool import ids_sha256

    ids = data["doc.1.ids"].clone()
    ids[3] = 1000  # the tiny model has 128 tokens
    data["doc.1.ids"] = ids
    h = ids_sha256(ids.tolist())
    m["documents"][1]["ids_sha256"], m["documents"][1]["id"] = h, "doc-" + h[:16]


def _ids_changed_no_manifest(data, m):
    data["doc.1.ids"] = data["doc.1.ids"].flip(0).contiguous()


def _setitem(name, fn):
    def f(data, m):
        t = data[name].clone()
        fn(t)
        data[name] = t
    return f


TENSOR_CASES = [
    ("scales missing", _drop("doc.0.layer.1.v.scales"), "'doc.0.layer.1.v.scales' is missing"),
    ("codes missing", _drop("doc.0.layer.0.k.codes"), "'doc.0.layer.0.k.codes' is missing"),
    ("ids missing", _drop("doc.1.ids"), "'doc.1.ids' is missing"),
    ("innerq missing", _drop("innerq.layer.0"), "InnerQ table does not match"),
    ("extra tensor", lambda d, m: d.__setitem__("doc.0.extra", torch.zeros(2)), "unexpected tensors"),
    ("placeholder beside documents", lambda d, m: d.__setitem__("empty", torch.zeros(1)), "unexpected tensors"),
    ("innerq of a layer that does not exist", lambda d, m: d.__setitem__("innerq.layer.5", torch.ones(2, 32)),
     "unexpected tensor 'innerq.layer.5'"),
    ("codes dtype", lambda d, m: d.__setitem__("doc.0.layer.0.k.codes", d["doc.0.layer.0.k.codes"].to(torch.int8)),
     "expected torch.uint8"),
    ("codes one row short", lambda d, m: d.__setitem__("doc.0.layer.1.v.codes", d["doc.0.layer.1.v.codes"][:, :, 1:].contiguous()),
     "doc.0.layer.1.v.codes"),
    ("scales dtype", lambda d, m: d.__setitem__("doc.0.layer.0.v.scales", d["doc.0.layer.0.v.scales"].float()),
     "expected torch.float16"),
    ("scales nan", _setitem("doc.0.layer.0.k.scales", lambda t: t.view(-1).__setitem__(5, float("nan"))), "non-finite"),
    ("scales inf", _setitem("doc.0.layer.1.v.scales", lambda t: t.view(-1).__setitem__(0, float("inf"))), "non-finite"),
    ("ids dtype", lambda d, m: d.__setitem__("doc.1.ids", d["doc.1.ids"].int()), "expected torch.int64"),
    ("ids changed", _ids_changed_no_manifest, "do not match ids_sha256"),
    ("ids outside the vocabulary", _ids_out_of_vocab, "vocabulary"),
    ("innerq negative", _setitem("innerq.layer.1", lambda t: t.view(-1).__setitem__(0, -1.0)), "finite and positive"),
    ("innerq nan", _setitem("innerq.layer.0", lambda t: t.view(-1).__setitem__(3, float("nan"))), "finite and positive"),
    ("innerq shape", lambda d, m: d.__setitem__("innerq.layer.0", d["innerq.layer.0"][:, :16].contiguous()),
     "innerq.layer.0"),
]


@pytest.mark.parametrize("name,mutate,match", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_tensor_file_consistent_but_wrong_is_refused(store, model_tok, name, mutate, match):
    """pool.safetensors rewritten and the manifest re-sealed to match it: the tensor checks must
    still refuse it."""
    edit_tensors(store, mutate)
    with pytest.raises(PoolFormatError, match=match):
        load(store, model_tok)


def test_tensor_file_header_metadata_and_garbage(store, model_tok):
    edit_tensors(store, lambda d, m: None, metadata={"format": "other"})
    with pytest.raises(PoolFormatError, match="header metadata"):
        load(store, model_tok)
    (current(store) / TENSORS).write_bytes(b"\xff" * 64)  # not safetensors, manifest consistent
    refile(store)
    with pytest.raises(PoolFormatError, match="not a readable safetensors file"):
        load(store, model_tok)


@pytest.mark.parametrize("missing", [MANIFEST, TENSORS, "generation", "store"])
def test_missing_file_is_refused(store, model_tok, missing):
    if missing == "generation":
        shutil.rmtree(current(store))
    elif missing == "store":
        shutil.rmtree(store)
    else:
        (current(store) / missing).unlink()
    with pytest.raises(PoolFormatError, match="missing|no saved polykv pool"):
        load(store, model_tok)


def test_flat_version1_layout_is_refused_clearly(store, model_tok):
    g = current(store)
    for f in (MANIFEST, TENSORS):
        shutil.move(g / f, store / f)
    g.rmdir()
    with pytest.raises(PoolFormatError, match="version 1"):
        load(store, model_tok)
    assert has_saved_pool(store)


# --- stray files ---------------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stray_files_are_ignored_and_cleaned(store, template, model_tok):
    dead, live = _dead_pid(), os.getppid()
    stray_dead = store / f".tmp-{dead}-abc123"
    stray_dead.mkdir()
    (stray_dead / MANIFEST).write_text("{broken")
    (stray_dead / TENSORS).write_bytes(b"half")
    stray_live = store / f".tmp-{live}-def456"
    stray_live.mkdir()
    (store / f".tmp-{dead}-0a").write_bytes(b"a stray temp file")
    (store / (TENSORS + ".tmp")).write_bytes(b"a version-1 temp file")
    (store / (MANIFEST + ".tmp")).write_text("{")
    (store / "notes.txt").write_text("the user's")
    (store / "pool-12").mkdir()  # not a generation name
    (store / "pool-99999999").write_text("a file, not a generation directory")
    old = store / "pool-00000000"  # an older, broken generation is never read
    old.mkdir()
    (old / MANIFEST).write_text("garbage")
    pool = load(store, model_tok)
    assert pool.generate(next(d["id"] for d in pool.documents() if d["resident"]), PROMPTS,
                         max_new_tokens=5) == template[1]
    pool.save(store)
    left = sorted(p.name for p in store.iterdir())
    # dead process temps, version-1 temps and the old generations are gone; a live process's temp
    # directory, the user's files and names that are not ours stay
    assert left == sorted([stray_live.name, "notes.txt", "pool-12", "pool-99999999", "pool-00000002"])
    assert load(store, model_tok).documents() == pool.documents()


def test_only_stray_files_is_not_a_saved_pool(tmp_path, model_tok):
    s = tmp_path / "s"
    s.mkdir()
    assert not has_saved_pool(s)
    (s / f".tmp-{_dead_pid()}-ab").mkdir()
    (s / "pool.safetensors.tmp").write_bytes(b"x")
    assert not has_saved_pool(s)
    with pytest.raises(PoolFormatError, match="no saved polykv pool"):
        load(s, model_tok)
    SharedKVPool(*model_tok).save(s)
    assert has_saved_pool(s) and [p.name for p in s.iterdir()] == ["pool-00000001"]


def test_server_starts_with_only_a_stray_temp_in_the_store(tmp_path, model_tok):
    """A stray temp dir of an interrupted save must not make startup fail (server/runner.py asks
    has_saved_pool)."""
    from polykv.server.runner import build_pool

    s = tmp_path / "store"
    s.mkdir()
    (s / f".tmp-{_dead_pid()}-ab").mkdir()
    pool = build_pool(*model_tok, store=s)
    assert pool.documents() == []


# --- interrupted saves ---------------------------------------------------------------------------

def _boom(*a, **k):
    raise OSError("disk full (injected)")


def _partial_save_file(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"\0" * 100)
    raise OSError("disk full (injected)")


def _interrupt(*a, **k):
    raise KeyboardInterrupt


FAULTS = [
    ("tensor write", "safetensors.torch.save_file", _partial_save_file),
    ("tensor fsync", "polykv.pool.persist._fsync_file", _boom),
    ("manifest write", "polykv.pool.persist._write_manifest", _boom),
    ("manifest sha", "polykv.pool.persist.manifest_sha256", _interrupt),
    ("rename", "polykv.pool.persist.os.rename", _boom),
]


@pytest.mark.parametrize("where,target,fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_save_interrupted_leaves_previous_save(store, template, model_tok, monkeypatch, where, target, fault):
    before = load(store, model_tok)
    before_docs = before.documents()
    before.add_document(list(range(3, 30)), name="new")
    monkeypatch.setattr(target, fault)
    with pytest.raises((OSError, KeyboardInterrupt)):
        before.save(store)
    monkeypatch.undo()
    assert [p.name for p in store.iterdir()] == ["pool-00000001"]  # the temp directory is removed
    again = load(store, model_tok)
    assert again.documents() == before_docs
    before.save(store)
    assert {d["name"] for d in load(store, model_tok).documents()} == {"d", None, "new"}


def test_save_refuses_what_load_would_refuse(store, model_tok):
    """A document name that is not a string would make an unloadable manifest: the save fails with
    PoolFormatError and the previous save stays the pool."""
    pool = load(store, model_tok)
    before = pool.documents()
    pool.add_document(list(range(3, 30)), name=5)
    with pytest.raises(PoolFormatError, match=r"documents\[2\].name"):
        pool.save(store)
    assert [p.name for p in store.iterdir()] == ["pool-00000001"]
    assert load(store, model_tok).documents() == before


def test_failed_cleanup_after_rename_keeps_the_new_save(store, model_tok, monkeypatch):
    pool = load(store, model_tok)
    pool.add_document(list(range(3, 30)), name="new")
    monkeypatch.setattr("polykv.pool.persist.shutil.rmtree", _boom)
    pool.save(store)  # cleanup failures are logged, not raised: the new generation is in place
    monkeypatch.undo()
    assert [p.name for p in gen_dirs(store)] == ["pool-00000001", "pool-00000002"]
    assert {d["name"] for d in load(store, model_tok).documents()} == {"d", None, "new"}


def test_reader_retries_when_a_concurrent_save_removes_its_generation(store, model_tok, monkeypatch):
    """A save that lands between the reader's manifest and its tensor file removes the generation
    being read: the reader moves on to the new one instead of failing."""
    writer = load(store, model_tok)
    writer.add_document(list(range(3, 30)), name="new")
    real = persist._fingerprints
    calls = []

    def racing(model, tok):
        calls.append(1)
        if len(calls) == 1:
            writer.save(store)  # generation 2 replaces 1 while the reader is inside generation 1
        return real(model, tok)

    monkeypatch.setattr(persist, "_fingerprints", racing)
    got = load(store, model_tok)
    assert {d["name"] for d in got.documents()} == {"d", None, "new"}
    assert len(calls) >= 2


_KILL_SCRIPT = textwrap.dedent(r"""
    import sys, time
    import torch
    torch.set_num_threads(1)
    from polykv.pool import SharedKVPool, persist
    from tests.pool.conftest import CharTok, tiny_llama

    store = sys.argv[1]
    real = persist._write_manifest
    def slow_manifest(path, manifest):
        real(path, manifest)
        print("tmp-complete", len(manifest["documents"]), flush=True)
        time.sleep(60)  # killed here: both files written in the temp dir, not renamed
    pool = SharedKVPool(tiny_llama(), CharTok(), prefill_chunk=32)
    pool.add_document(list(range(3, 40)), name="first")
    pool.save(store)
    print("saved", flush=True)
    pool.add_document(list(range(40, 80)), name="second")
    persist._write_manifest = slow_manifest
    pool.save(store)
""")


def test_save_killed_midway_leaves_previous_save(tmp_path, model_tok):
    """A process killed (SIGKILL) inside a save, after both files of the new save are written but
    before the rename: the previous save loads; the next save removes the dead process's temp dir."""
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(store)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("tmp-complete"):
                break
        assert lines[-1:] == ["tmp-complete 2"], (lines, proc.stderr.read() if proc.poll() is not None else "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
        proc.stderr.close()
    tmp, gen = sorted(p.name for p in store.iterdir())
    assert gen == "pool-00000001" and tmp.startswith(f".tmp-{proc.pid}-")
    assert sorted(p.name for p in (store / tmp).iterdir()) == [MANIFEST, TENSORS]  # complete, not renamed
    pool = load(store, model_tok)
    assert [d["name"] for d in pool.documents()] == ["first"]
    pool.save(store)
    assert [p.name for p in store.iterdir()] == ["pool-00000002"]


def test_a_generation_directory_loads_and_the_save_fixes_the_types(store, template, model_tok):
    """Naming a `pool-<generation>` directory loads that generation (it was told to "re-add its
    documents" as a version-1 save); k / v / preset / innerq / overrides come from the save only."""
    gen = current(store)
    pool = SharedKVPool.load(gen, *model_tok)
    doc = next(d["id"] for d in pool.documents() if d["resident"])
    assert pool.generate(doc, PROMPTS, max_new_tokens=5) == template[1]
    for bad in ({"k": "q4_0"}, {"v": "turbo2"}, {"preset": "max"}, {"innerq": None}):
        with pytest.raises(TypeError, match="from the save"):
            SharedKVPool.load(store, *model_tok, **bad)
