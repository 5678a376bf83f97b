"""Publishing one document's compressed KV so that another process adds it without a prefill.

    src = export_document(pool, doc_id)              # {"manifest.json": bytes, "pool.safetensors": uint8 array}
    src = export_document(pool, doc_id, store=dir)   # or "<dir>/docs/<doc_id>" (a shared filesystem)
    doc_id = import_document(other_pool, src)        # same model and codecs: no prefill

The published form is a one-document save in the pool's own format (`pool/persist.py`: safetensors +
manifest with model / tokenizer fingerprints, sha256 digests, codecs), and the import goes through
`SharedKVPool.load`, so it refuses exactly what a pool load refuses (another model, another
tokenizer, a corrupted or truncated file, ...) and, on top, a save whose K/V types or InnerQ table
differ from the receiving pool's (its document would attend with other codecs than its agents).

The files dict is what travels through Ray's object store: the tensors as a numpy uint8 array, read
zero-copy on the node (`ray.get` maps the store's buffer), then written once to a temporary
directory (RAM-backed /dev/shm where there is one) for the checked load.

Both functions touch the pool's document table (`_docs`, `_lock`, `_enforce_budget`): the pool has
no public "adopt a loaded document" call; this is the one place outside `polykv/pool` that does.
Run them on the engine thread (`ServerState.on_engine`), like every other pool mutation.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

__all__ = ["MANIFEST", "TENSORS", "document_id", "export_document", "import_document", "published_documents"]

MANIFEST = "manifest.json"
TENSORS = "pool.safetensors"


def document_id(pool, text_or_ids) -> str:
    """The id `pool.add_document(text_or_ids)` gives (tokenization only, no model work)."""
    from ..pool.pool import ids_sha256

    return "doc-" + ids_sha256(pool._doc_tokens(text_or_ids)[0])[:16]


def _tmpdir() -> str:
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix="polykv-doc-", dir=shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None)


def _one_doc_pool(pool, doc_id: str):
    from ..pool import SharedKVPool

    d = pool._doc(doc_id)
    if not d.resident:
        raise ValueError(f"document {doc_id!r} is evicted (token ids only): nothing to publish")
    sub = SharedKVPool(pool.model, pool.tok, k=pool.k_type, v=pool.v_type, device=pool.device, innerq=pool.innerq,
                       overrides=dict(enumerate(pool.layer_types)))
    sub._docs[doc_id] = d  # the same _Document: its layers are read, not copied
    return sub


def export_document(pool, doc_id: str, store: str | os.PathLike | None = None):
    """Publish resident document `doc_id` of `pool` (engine thread). With `store`: a save in
    `<store>/docs/<doc_id>/` (atomic, fsynced: persist.py), returned as a path string. Without: the
    two files of the save as {"manifest.json": bytes, "pool.safetensors": numpy uint8 array}."""
    import numpy as np

    sub = _one_doc_pool(pool, doc_id)
    if store is not None:
        path = Path(store) / "docs" / doc_id
        sub.save(path)
        return str(path)
    tmp = _tmpdir()
    try:
        sub.save(tmp)
        from ..pool.persist import _gen_dir, generations

        gdir = _gen_dir(Path(tmp), generations(tmp)[-1])
        return {MANIFEST: (gdir / MANIFEST).read_bytes(),
                TENSORS: np.frombuffer((gdir / TENSORS).read_bytes(), dtype=np.uint8)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load(pool, source):
    from ..pool import SharedKVPool

    if isinstance(source, (str, os.PathLike)):
        return SharedKVPool.load(str(source), pool.model, pool.tok, device=pool.device)
    tmp = _tmpdir()
    try:
        gdir = Path(tmp) / "pool-00000001"
        gdir.mkdir()
        (gdir / MANIFEST).write_bytes(bytes(source[MANIFEST]))
        with open(gdir / TENSORS, "wb") as f:
            f.write(memoryview(source[TENSORS]))
        return SharedKVPool.load(tmp, pool.model, pool.tok, device=pool.device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def import_document(pool, source) -> list[str]:
    """Add the published document(s) of `source` (a path from `export_document(..., store=)` or its
    files dict) to `pool` without a prefill (engine thread). Checked as `SharedKVPool.load` checks a
    save, plus the K/V types and InnerQ table against `pool` (PoolFormatError). A document `pool`
    already holds resident is left as it is; an evicted one gets the published KV. The pool's
    budgets are then enforced (LRU demotion / eviction of other unused documents). Returns the ids."""
    from ..pool.persist import innerq_sha256
    from ..pool.pool import PoolFormatError

    loaded = _load(pool, source)
    if loaded.layer_types != pool.layer_types or innerq_sha256(loaded.innerq) != innerq_sha256(pool.innerq):
        raise PoolFormatError(f"published document uses K {loaded.k_type} / V {loaded.v_type} "
                              f"(InnerQ {innerq_sha256(loaded.innerq)}); this pool holds K {pool.k_type} / "
                              f"V {pool.v_type} (InnerQ {innerq_sha256(pool.innerq)})"
                              + ("" if (loaded.k_type, loaded.v_type) != (pool.k_type, pool.v_type)
                                 else " with other per-layer types"))
    ids = []
    with pool._lock:
        for did, d in loaded._docs.items():
            ids.append(did)
            cur = pool._docs.get(did)
            if cur is not None and cur.resident:
                continue
            if cur is not None:
                d.name = d.name or cur.name
            d.last_used = time.monotonic()
            pool._docs[did] = d
            pool._enforce_budget(keep=did)
    return ids


def published_documents(store: str | os.PathLike) -> dict[str, dict]:
    """The documents published in `<store>/docs/` ({id: {"id", "name", "tokens", "path"}}), read from
    each save's manifest (its digests are checked when a replica loads it)."""
    import json

    from ..pool.persist import _gen_dir, generations

    out: dict[str, dict] = {}
    root = Path(store) / "docs"
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        gens = generations(d)
        if not gens:
            continue
        try:
            m = json.loads((_gen_dir(d, gens[-1]) / MANIFEST).read_text(encoding="utf-8"))
            for doc in m["documents"]:
                out[doc["id"]] = {"id": doc["id"], "name": doc["name"], "tokens": int(doc["tokens"]),
                                  "path": str(d)}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a readable save: a replica's load would refuse it anyway
    return out
