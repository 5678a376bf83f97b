"""Fingerprints of a model's weights and of a tokenizer: the one `model_fingerprint`.

Pool persistence checks a save against `model_fingerprint` / `tokenizer_fingerprint`; the InnerQ
table calibrated for a model is found by `innerq_key` (its first 16 hex digits, after the model type)
under `polykv.paths.cache_dir("innerq")`.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import torch

__all__ = ["innerq_key", "innerq_path", "model_fingerprint", "tokenizer_fingerprint"]

_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "_commit_hash",
    "transformers_version",
    "quantization_config",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "attn_implementation",
    "use_cache",
    "dtype",
    "torch_dtype",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}


def _strip_volatile(obj):
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(obj, list):
        return [_strip_volatile(v) for v in obj]
    return obj


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (key, hex)


def model_fingerprint(model) -> str:
    """sha256 hex of the model's architecture config, a safetensors-style header of its state dict
    (every name with dtype and shape; a tied name points at the name it shares storage with) and a
    sha256 digest of the bytes of every distinct tensor — all of them, no sampling.

    Stable across processes, devices and load paths of the same weights; changes with any value,
    dtype, shape or name. Cost: one pass over the weights, hashed in threads (SmolLM2-135M on
    two CPU cores: ~0.4 s). The result is cached per model object while no tensor of its state dict is
    replaced, moved, re-typed or written in place through autograd's view of it (storage pointer and
    version counter unchanged); a write through `param.data` is invisible to that counter.
    """
    from concurrent.futures import ThreadPoolExecutor

    state = model.state_dict(keep_vars=True)
    names = sorted(state)
    key = tuple((n, id(state[n]), state[n].data_ptr(), state[n]._version, state[n].dtype,
                 tuple(state[n].shape), str(state[n].device)) for n in names)
    hit = _FINGERPRINTS.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    header, distinct, first = {}, [], {}
    for n in names:
        t = state[n]
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in first and t.numel():
            header[n] = {"alias_of": first[ident]}
            continue
        first.setdefault(ident, n)
        header[n] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        distinct.append(t)

    def digest(t: torch.Tensor) -> str:
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        return hashlib.sha256(data).hexdigest()  # releases the GIL: the threads hash in parallel

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as ex:
        digests = list(ex.map(digest, distinct))
    h = hashlib.sha256()
    cfg = _strip_volatile(model.config.to_dict())
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(json.dumps(header, sort_keys=True).encode())
    for d in digests:
        h.update(bytes.fromhex(d))
    out = h.hexdigest()
    try:
        _FINGERPRINTS[model] = (key, out)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return out


def tokenizer_fingerprint(tok) -> str:
    """sha256 hex of the tokenizer's model (vocab/merges), normalizer/pre-tokenizer, special tokens
    and chat template. Runtime padding/truncation settings and padding side are ignored."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        data = json.loads(backend.to_str())
        data.pop("padding", None)
        data.pop("truncation", None)
        h.update(json.dumps(data, sort_keys=True).encode())
    else:  # slow tokenizer
        h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
        merges = getattr(tok, "bpe_ranks", None)
        if merges:
            h.update(json.dumps(sorted((" ".join(k), v) for k, v in merges.items())).encode())
    special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    h.update(json.dumps(special, sort_keys=True, default=str).encode())
    template = getattr(tok, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True, default=str).encode())
    return h.hexdigest()


def innerq_key(model) -> str:
    """"<model_type>-<first 16 hex of model_fingerprint>": names the model's InnerQ table."""
    return f"{getattr(model.config, 'model_type', 'model')}-{model_fingerprint(model)[:16]}"


def innerq_path(model) -> Path:
    """Where the InnerQ table calibrated for `model` lives: cache_dir("innerq")/<innerq_key>.safetensors."""
    from ..paths import cache_dir

    return cache_dir("innerq") / f"{innerq_key(model)}.safetensors"
