"""The served models as the API sees them: ModelCards from Redis, with a tokenizer and chat template each.

Workers publish a ``ModelCard`` (including the fast tokenizer's JSON) when they register. The API builds a
``tokenizers.Tokenizer`` from it, never ``transformers`` (which would import torch and take seconds). Cards are
re-read at most every ``refresh_s`` so a new worker's model appears quickly, and a tokenizer or template is
rebuilt only when its source text changed (building SmolLM2's tokenizer takes ~50 ms).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
from tokenizers import Tokenizer

from api.chat_template import ChatTemplate
from shared.queue import JobQueue
from shared.schemas import ModelCard

log = logging.getLogger(__name__)


# The fewest characters a token may be credited with when bounding a prompt's length (below, ``max_prompt_chars``).
MIN_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class ServedModel:
    """One model clients may ask for. ``card`` is None when the API is configured for a model that no worker
    has published yet: jobs for it are still queued (a worker may start later) but not length-checked.

    Tokenizing runs on a thread (``tokenize_limiter`` bounds how many at once) with the GIL released, so a
    megabyte prompt never stalls the event loop, and every other request with it.
    """

    name: str
    card: ModelCard | None
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    tokenize_limiter: anyio.CapacityLimiter | None = None
    max_token_chars: int = MIN_CHARS_PER_TOKEN

    @property
    def max_model_len(self) -> int | None:
        return self.card.max_model_len if self.card else None

    @property
    def max_prompt_chars(self) -> int | None:
        """More characters than any prompt that fits the context can have, checked before tokenizing.

        ``max_model_len`` tokens times the longest token of the vocabulary (in characters; at least
        ``MIN_CHARS_PER_TOKEN``). For byte-level BPE vocabularies (every built-in model) a token covers at most as
        many characters as its vocabulary entry has, so no longer prompt can fit: SmolLM2, 8192 tokens x 81
        characters = 663 552. A tokenizer that maps an unknown word of any length to one token (word-level) may
        see a prompt refused that would have fit; such a prompt is pathological.
        """
        if self.max_model_len is None or self.tokenizer is None:
            return None
        return self.max_model_len * self.max_token_chars

    async def count_prompt_tokens(self, prompt: str) -> int | None:
        """Tokens of a plain prompt (with the tokenizer's BOS etc., as the worker encodes it); None = unknown."""
        return await self._count(prompt, add_special_tokens=True)

    async def count_chat_tokens(self, rendered: str) -> int | None:
        """Tokens of a rendered chat template (no special tokens added: the template writes them)."""
        return await self._count(rendered, add_special_tokens=False)

    async def _count(self, text: str, *, add_special_tokens: bool) -> int | None:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None

        def count() -> int:
            # encode_batch releases the GIL while it works (encode does not): the event loop keeps running.
            return len(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

        return await anyio.to_thread.run_sync(count, limiter=self.tokenize_limiter)


@dataclass
class _Built:
    """A tokenizer or template built from a card, and what it was built from. ``card`` is the card object seen
    last: the source text (megabytes for a tokenizer) is compared only when a refresh brought a new card."""

    source: str
    value: Any
    card: ModelCard | None = None
    max_token_chars: int = MIN_CHARS_PER_TOKEN


class ModelCatalog:
    """Per-app cache of served models, refreshed from the queue's model cards."""

    def __init__(self, queue: JobQueue, configured_model: str, refresh_s: float = 5.0, tokenize_threads: int = 2
                 ) -> None:
        self._queue = queue
        self._tokenize_limiter = anyio.CapacityLimiter(tokenize_threads)
        self._configured_model = configured_model
        self._refresh_s = refresh_s
        self._cards: dict[str, ModelCard] = {}
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()
        self._tokenizers: dict[str, _Built] = {}
        self._templates: dict[str, _Built] = {}

    async def _refresh(self) -> None:
        if time.monotonic() - self._fetched_at < self._refresh_s:
            return
        async with self._lock:  # one Redis read per refresh however many requests are waiting
            if time.monotonic() - self._fetched_at < self._refresh_s:
                return
            cards = await self._queue.model_cards()
            self._cards = {card.name: card for card in cards}
            self._fetched_at = time.monotonic()

    async def names(self) -> list[str]:
        """Every model a request may name: those with a published card, plus the configured one."""
        await self._refresh()
        return sorted(set(self._cards) | {self._configured_model})

    async def default_name(self) -> str:
        """The model used when a request names none: the configured one if it is served (or nothing is
        published yet), else the only/first published model."""
        await self._refresh()
        if self._configured_model in self._cards or not self._cards:
            return self._configured_model
        return sorted(self._cards)[0]

    async def get(self, name: str) -> ServedModel | None:
        """The served model called ``name``, or None when no such model is known."""
        await self._refresh()
        card = self._cards.get(name)
        if card is None and name not in self._cards:
            # A model that just appeared must not wait for the next refresh to become usable.
            card = await self._queue.model_card(name)
            if card is not None:
                self._cards[name] = card
        if card is None:
            if name != self._configured_model:
                return None
            return ServedModel(name=name, card=None, tokenizer=None, chat_template=None)
        built = self._tokenizer(card)
        return ServedModel(name=name, card=card, tokenizer=built.value if built else None,
                           chat_template=self._chat_template(card), tokenize_limiter=self._tokenize_limiter,
                           max_token_chars=built.max_token_chars if built else MIN_CHARS_PER_TOKEN)

    def _tokenizer(self, card: ModelCard) -> _Built | None:
        if card.tokenizer_json is None:
            return None
        built = self._tokenizers.get(card.name)
        if built is None or (built.card is not card and built.source != card.tokenizer_json):
            try:
                tokenizer = Tokenizer.from_str(card.tokenizer_json)
                longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
                built = _Built(card.tokenizer_json, tokenizer, max_token_chars=max(MIN_CHARS_PER_TOKEN, longest))
            except Exception:
                # A card from a newer/odd tokenizers version: serve without API-side counting, say so once.
                log.warning("cannot build the tokenizer of model %s; prompt lengths are checked by the worker only",
                            card.name, exc_info=True)
                built = _Built(card.tokenizer_json, None)
        built.card = card
        self._tokenizers[card.name] = built
        return built

    def _chat_template(self, card: ModelCard) -> ChatTemplate | None:
        if card.chat_template is None:
            return None
        key = card.chat_template + "\0" + repr(sorted(card.special_tokens.items()))
        built = self._templates.get(card.name)
        if built is None or built.source != key:
            built = _Built(key, ChatTemplate(card.chat_template, card.special_tokens))
            self._templates[card.name] = built
        template: ChatTemplate = built.value
        return template
