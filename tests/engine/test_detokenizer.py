"""Incremental detokenizer with SmolLM2's real tokenizer: exact streaming of multi-byte text and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.engine.detokenizer import BackendDecoder, DetokenizerUpdate, IncrementalDetokenizer, direct_decoder

TEXTS = [
    "Héllo wörld, ça va? Crème brûlée à la carte.",
    "中文字符测试：你好，世界！日本語のテキストも。한국어 텍스트",
    "Emoji 🎉🚀 and families 👩‍👩‍👧‍👦 with flags 🇫🇷🇯🇵 and skin tones 👍🏽.",
    "Mixed: naïve café — “quotes” … ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2)


def _stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: tuple[str, ...] = (), chunk: int = 1
            ) -> tuple[IncrementalDetokenizer, list[DetokenizerUpdate]]:
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)
    updates = [det.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return det, updates


@pytest.mark.parametrize("text", TEXTS, ids=["latin", "cjk", "emoji", "symbols"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_text_streams_without_replacement_chars_and_concatenates_exactly(
        tokenizer: PreTrainedTokenizerBase, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    det, updates = _stream(tokenizer, ids, chunk=chunk)
    tail = det.flush()
    deltas = [u.text_delta for u in updates] + [tail]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(u.stop_hit for u in updates)


def test_fixture_text_really_splits_characters_across_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    # Guards the test above: some tokens of TEXTS decode alone to U+FFFD, so holding back is exercised.
    split = [i for text in TEXTS for i in tokenizer.encode(text) if "\ufffd" in tokenizer.decode([i])]
    assert len(split) > 10


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi there 🙂<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    det, updates = _stream(tokenizer, ids)
    assert "".join(u.text_delta for u in updates) + det.flush() == "assistant\nHi there 🙂"


def test_stop_string_spanning_tokens_truncates_and_holds_back_its_start(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Hello world, the end is near.")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[:5] == ["Hello", " world", ",", " the", " end"]  # the stop "d, th" spans three tokens
    det, updates = _stream(tokenizer, ids, stop=("d, th",))
    assert [(u.text_delta, u.stop_hit) for u in updates[:4]] == [
        ("Hello", False), (" worl", False), ("", False), ("", True)]  # "d" and "d," held back; "d, th" hits
    assert all(u == DetokenizerUpdate("", True) for u in updates[4:])  # later tokens are ignored
    assert det.text == "Hello worl" and det.stop_hit
    assert det.flush() == "" and det.text == "Hello worl"


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop(tokenizer: PreTrainedTokenizerBase
                                                                          ) -> None:
    ids = tokenizer.encode("Hello world, then more")
    det, updates = _stream(tokenizer, ids, stop=("d, th!",))
    text = "".join(u.text_delta for u in updates)
    assert text == "Hello world, then more" and not any(u.stop_hit for u in updates)


def test_flush_releases_text_held_back_at_the_end(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("The answer is 42 and STO")
    det, updates = _stream(tokenizer, ids, stop=("STOP",))
    assert "".join(u.text_delta for u in updates) == "The answer is 42 and "
    assert det.text == "The answer is 42 and "
    assert det.flush() == "STO"
    assert det.text == "The answer is 42 and STO"


def test_stop_string_with_multibyte_characters_is_not_returned(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode("Party time 🎉🚀 now go")
    det, updates = _stream(tokenizer, ids, stop=("🚀",))
    assert "".join(u.text_delta for u in updates) == det.text == "Party time 🎉"
    assert updates[-1].stop_hit


def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    # Both stops complete on the token " gamma"; the one that starts first wins, not the first listed.
    ids = tokenizer.encode("alpha beta gamma delta")
    det, updates = _stream(tokenizer, ids, chunk=len(ids), stop=("gamma", "beta gamma"))
    assert updates[0] == DetokenizerUpdate("alpha ", True) and det.text == "alpha "


def test_stop_string_at_the_very_start_gives_empty_text(tokenizer: PreTrainedTokenizerBase) -> None:
    det, updates = _stream(tokenizer, tokenizer.encode("Stop here"), stop=("Stop",))
    assert updates[0] == DetokenizerUpdate("", True) and det.text == ""


def test_decode_window_stays_short_on_long_outputs(tokenizer: PreTrainedTokenizerBase) -> None:
    """Per-token cost is O(1): every decode call sees only a few ids, however long the output gets."""
    window_sizes: list[int] = []

    class Recording:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            window_sizes.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    text = " ".join(TEXTS) * 5
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(Recording(), [], ("never appears",))
    streamed = "".join(det.push([i]).text_delta for i in ids) + det.flush()
    assert streamed == text and len(ids) > 500
    assert max(window_sizes) <= 8


def test_direct_decoder_decodes_what_transformers_decodes(tokenizer: PreTrainedTokenizerBase) -> None:
    """SmolLM2's fast tokenizer decodes through its Rust backend, to the very text of ``tokenizer.decode`` on every
    window a stream asks for, special tokens and split characters included."""
    decoder = direct_decoder(tokenizer)
    assert isinstance(decoder, BackendDecoder)
    ids = tokenizer.encode(" ".join(TEXTS)) + tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    for start in range(len(ids)):
        for end in range(start, min(start + 6, len(ids)) + 1):
            for skip in (True, False):
                assert decoder.decode(ids[start:end], skip_special_tokens=skip) == tokenizer.decode(
                    ids[start:end], skip_special_tokens=skip)


def test_direct_decoder_keeps_transformers_decode_where_it_adds_a_clean_up(smollm2: Path) -> None:
    cleaning = AutoTokenizer.from_pretrained(smollm2, clean_up_tokenization_spaces=True)
    assert direct_decoder(cleaning) is cleaning
