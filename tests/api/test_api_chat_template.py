"""Chat templates render as transformers renders them, and prompt tokens are counted from the ModelCard."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.chat_template import ChatTemplate, ChatTemplateError
from api.tokenization import ServedModel
from shared.schemas import ModelCard
from tests.worker.scripted_engine import CHATML, model_card

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, {{ not jinja }}"}]


def test_chatml_renders_with_the_generation_prompt() -> None:
    rendered = ChatTemplate(CHATML, {}).render(MESSAGES)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHéllo, {{ not jinja }}"
                        "<|im_end|>\n<|im_start|>assistant\n")


def test_template_helpers_and_errors() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages | tojson }}{% if messages|length > 1 %}"
                            "{{ raise_exception('one message only') }}{% endif %}", {"bos_token": "<s>"})
    assert template.render(MESSAGES[1:]) == '<s>[{"role": "user", "content": "Héllo, {{ not jinja }}"}]'
    with pytest.raises(ChatTemplateError, match="one message only"):
        template.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {}).render(MESSAGES)
    # The sandbox refuses attribute tricks a malicious template could try.
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {}).render(MESSAGES)


async def test_prompt_tokens_are_counted_from_the_card() -> None:
    card = model_card()
    from tokenizers import Tokenizer

    assert card.tokenizer_json is not None
    model = ServedModel(card.name, card, Tokenizer.from_str(card.tokenizer_json), ChatTemplate(CHATML, {}))
    assert await model.count_prompt_tokens("hello quick brown fox") == 4


def _smollm2_folder() -> Path | None:
    from worker.models import default_cache_dir

    folder = default_cache_dir() / "smollm2"
    return folder if (folder / "tokenizer.json").is_file() else None


@pytest.mark.skipif(_smollm2_folder() is None, reason="SmolLM2 not prepared (make setup converts it)")
async def test_smollm2_template_and_counts_match_transformers() -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = _smollm2_folder()
    hf = AutoTokenizer.from_pretrained(folder)
    card = ModelCard(name="smollm2", max_model_len=8192, eos_token_ids=[hf.eos_token_id], vocab_size=len(hf),
                     chat_template=hf.chat_template, tokenizer_json=hf.backend_tokenizer.to_str(),
                     special_tokens={k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)})
    assert card.chat_template is not None and card.tokenizer_json is not None
    model = ServedModel(card.name, card, Tokenizer.from_str(card.tokenizer_json),
                        ChatTemplate(card.chat_template, card.special_tokens))
    assert model.chat_template is not None
    rendered = model.chat_template.render(MESSAGES)
    assert rendered == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert await model.count_chat_tokens(rendered) == len(ids)
    assert await model.count_prompt_tokens("The capital of France is") == len(hf("The capital of France is").input_ids)
