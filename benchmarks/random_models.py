"""Random-weight Llama-family models built from a config, saved as folders the engine can load.

A GPU machine here has no network and no model files, so the GPU check builds its models: the shapes of
SmolLM2-135M and of a ~1B Llama (Llama-3.2-1B's), plus tiny versions of both for CPU tests. A word-level
tokenizer over the whole vocabulary (``t0``, ``t1``, ...) is saved beside the weights: the engine needs a tokenizer
to detokenize, and benchmarks use token-id prompts, so its quality does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture shape; ``tiny`` ones exist so CPU tests exercise every code path in seconds."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


SHAPES = {
    "smollm2-135m": ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 49152, 8192, rope_theta=100000.0),
    "llama-1b": ModelShape("llama-1b", 2048, 8192, 16, 32, 8, 128256, 8192, rope_theta=500000.0),
    "smollm2-tiny": ModelShape("smollm2-tiny", 64, 128, 2, 4, 2, 2048, 1024),
    "llama-1b-tiny": ModelShape("llama-1b-tiny", 128, 256, 2, 8, 2, 2048, 1024),
}
BOS_ID, EOS_ID = 1, 2


def llama_config(shape: ModelShape):
    """The transformers ``LlamaConfig`` for a shape."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                       num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
                       num_key_value_heads=shape.num_key_value_heads, vocab_size=shape.vocab_size,
                       max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
                       tie_word_embeddings=shape.tie_word_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=EOS_ID)


def build_model(shape: ModelShape, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Random weights (transformers' own initialisation), created directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(shape), dtype=dtype)
    return model.eval()


def word_level_tokenizer(vocab_size: int):
    """A fast tokenizer whose token ``i`` is the word ``t{i}``; BOS ``t1``, EOS and padding ``t2``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", bos_token=f"t{BOS_ID}",
                                   eos_token=f"t{EOS_ID}", pad_token=f"t{EOS_ID}")


def save_model_folder(model: torch.nn.Module, folder: Path) -> Path:
    """Save weights, config and the word-level tokenizer where ``EngineConfig(model=str(folder))`` finds them."""
    model.save_pretrained(folder)
    word_level_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameter tensors (a tied embedding counted once): what a decode step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
