"""A scripted engine behind the worker's engine port (``worker.port.EnginePort``), and the real worker around it.

Tests of the API and the load generator run the production worker (claiming, the step loop, the outbox, lease
renewal, cancellations) in process over this engine, whose output the tests can predict: choice ``i``'s ``k``-th
token is ``"<word>-<k> "`` with ``word`` cycling through the prompt's words from the ``i``-th, so a client that got
a token twice, lost one or received them out of order sees different text than ``expected_text`` predicts.
Prompts are tokenized with a word-level tokenizer (the model card's), so token counts are obvious.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from shared import keys
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import ModelCard
from worker.engine import EngineStats, Logprob, SamplingParams, StepOutput
from worker.engine_thread import EngineThread
from worker.jobs import model_card as worker_model_card
from worker.runner import Runner

MODEL = "tiny-test"
MAX_MODEL_LEN = 512
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["[UNK]", "hello", "world", "the", "quick", "brown", "fox", "<|im_start|>", "<|im_end|>", "user",
         "assistant", "system", "<|", "|>", "im_start", "im_end"]
TEMPLATE_WORDS = {"<|im_start|>", "<|im_end|>", "<|", "|>", "im_start", "im_end", "user", "assistant", "system"}
PIECE_IDS_FROM = 10_000  # generated pieces get their own token ids (decode() returns their text)
VOCAB_SIZE = 1_000_000


def word_tokenizer() -> Tokenizer:
    """One token per whitespace/punctuation-separated word; unknown words are ``[UNK]``."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer


def prompt_words(token_ids: Sequence[int]) -> list[str]:
    """The words the script cycles through: the prompt's, without the chat template's own tokens."""
    words = [WORDS[t] if t < len(WORDS) else f"t{t}" for t in token_ids]
    return [w for w in words if w not in TEMPLATE_WORDS] or ["_"]


def piece(words: list[str], k: int, index: int = 0) -> str:
    return f"{words[(k + index) % len(words)]}-{k} "


def expected_text(source: str | list[int], max_tokens: int, index: int = 0, stop: tuple[str, ...] = ()) -> str:
    """What the scripted engine generates for a prompt (text, or token ids), choice ``index``."""
    ids = source if isinstance(source, list) else word_tokenizer().encode(source).ids
    words = prompt_words(ids)
    text = "".join(piece(words, k, index) for k in range(max_tokens))
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


class ScriptedTokenizer:
    """The word-level tokenizer with the ChatML template; ``decode`` also knows the generated pieces."""

    def __init__(self) -> None:
        self._hf = PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(), chat_template=CHATML,
                                           unk_token="[UNK]", eos_token="<|im_end|>", bos_token="<|im_start|>")
        self.backend_tokenizer = self._hf.backend_tokenizer
        self.chat_template: str | None = CHATML
        self.special_tokens_map: dict[str, Any] = dict(self._hf.special_tokens_map)
        self._pieces: dict[str, int] = {}
        self._texts: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self._texts.get(t) or self._hf.decode([t]) for t in token_ids)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._hf.apply_chat_template(conversation, **kwargs)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return self._hf(text, **kwargs)

    def piece_id(self, text: str) -> int:
        if text not in self._pieces:
            self._pieces[text] = PIECE_IDS_FROM + len(self._pieces)
            self._texts[self._pieces[text]] = text
        return self._pieces[text]


@dataclass
class _Request:
    words: list[str]
    index: int
    params: SamplingParams
    max_tokens: int
    num_prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


class ScriptedEngine:
    """``EnginePort`` with scripted text, ``token_delay_s`` per step, up to ``max_num_seqs`` requests at once."""

    def __init__(self, token_delay_s: float = 0.0, max_num_seqs: int = 64) -> None:
        self.tokenizer = ScriptedTokenizer()
        self.max_model_len = MAX_MODEL_LEN
        self.vocab_size = VOCAB_SIZE
        self.eos_token_ids = [WORDS.index("<|im_end|>")]
        self.token_delay_s = token_delay_s
        self.max_num_seqs = max_num_seqs
        self.added: list[str] = []  # request ids, in order
        self.aborted: list[str] = []
        self._requests: dict[str, _Request] = {}

    def add_request_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids must have at most {self.max_model_len - 1} tokens, "
                             f"got {len(prompt_token_ids)}")
        for token_id in (*prompt_token_ids, *params.stop_token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {token_id}")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt_token_ids))
        for i, rid in enumerate(request_ids):
            self._requests[rid] = _Request(prompt_words(prompt_token_ids), i, params, max_tokens,
                                           len(prompt_token_ids))
            self.added.append(rid)

    def step(self) -> list[StepOutput]:
        if self.token_delay_s and self._requests:
            time.sleep(self.token_delay_s)  # paces the script like a model's step would
        outputs = [self._advance(rid, r) for rid, r in list(self._requests.items())]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _advance(self, rid: str, request: _Request) -> StepOutput:
        k = len(request.token_ids)
        text = piece(request.words, k, request.index)
        stopped = False
        for stop in request.params.stop:
            combined = request.text + text
            if stop in combined:
                text, stopped = combined[: combined.index(stop)][len(request.text):], True
                break
        token_id = self.tokenizer.piece_id(text)
        request.text += text
        request.token_ids.append(token_id)
        finished = stopped or len(request.token_ids) >= request.max_tokens
        logprobs = () if request.params.logprobs is None else (Logprob(
            token_id, -0.25, tuple([(token_id, -0.25), (token_id + 1, -1.5), (token_id + 2, -2.5)][
                :request.params.logprobs])),)
        return StepOutput(request_id=rid, new_token_ids=(token_id,), text_delta=text, finished=finished,
                          finish_reason=("stop" if stopped else "length") if finished else None,
                          num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=len(request.token_ids),
                          logprobs=logprobs)

    def abort(self, request_id: str) -> bool:
        found = self._requests.pop(request_id, None) is not None
        if found:
            self.aborted.append(request_id)
        return found

    def free_seats(self) -> int:
        return max(0, self.max_num_seqs - len(self._requests))

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._requests), num_waiting=0, num_total_blocks=1, num_free_blocks=1,
                           num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)


def model_card(name: str = MODEL, max_model_len: int = MAX_MODEL_LEN) -> ModelCard:
    """The card a worker over the scripted engine registers (built by the production ``model_card``)."""
    engine = ScriptedEngine()
    engine.max_model_len = max_model_len
    return worker_model_card(name, engine)


def _job_ids(request_ids: list[str]) -> list[str]:
    return list(dict.fromkeys(rid.rpartition("#")[0] for rid in request_ids))


class InProcessWorker:
    """The production worker (``worker.runner.Runner``) over a ``ScriptedEngine``, in its own thread and event
    loop as a worker process would be, so synchronous test clients can block while it works."""

    def __init__(self, redis_url: str, settings: Settings, token_delay_s: float = 0.0,
                 worker_id: str = "scripted-1", make_engine: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.engine_thread = EngineThread()
        # make_engine: another engine (a real one, for client-compatibility tests) instead of the scripted one
        self.engine = self.engine_thread.build(make_engine or (lambda: ScriptedEngine(token_delay_s,
                                                                                      settings.max_num_seqs)))
        self._redis_url = redis_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=worker_id, daemon=True)
        self._runner: Runner | None = None
        self._main: Future[int] | None = None

    @property
    def claimed(self) -> list[str]:
        """Job ids that reached the engine, in order."""
        return _job_ids(self.engine.added)

    @property
    def cancelled(self) -> set[str]:
        """Job ids whose requests were aborted (cancellations)."""
        return set(_job_ids(self.engine.aborted))

    def start(self) -> InProcessWorker:
        self._thread.start()
        registered: Future[None] = Future()
        self._main = asyncio.run_coroutine_threadsafe(self._run(registered), self._loop)
        registered.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._runner is not None and self._main is not None:
            self._loop.call_soon_threadsafe(self._runner.request_stop)
            self._main.result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _run(self, registered: Future[None]) -> int:
        # Many live streams subscribe at once in some tests: more than redis-py's default pool (100).
        client = aioredis.Redis.from_url(self._redis_url, max_connections=1000)
        self._runner = Runner(self.engine, self.engine_thread, JobQueue(client, self.settings), self.settings,
                              self.worker_id)
        try:
            task = asyncio.create_task(self._runner.run())
            while not await client.zscore(keys.WORKERS, self.worker_id):
                if task.done():
                    return task.result()
                await asyncio.sleep(0.01)
            registered.set_result(None)
            return await task
        finally:
            await _cancel_other_tasks()  # a background task the runner left (stuck on a loaded machine) must not
            await client.aclose()  # reconnect after this close: its socket would leak into a later test's GC


async def _cancel_other_tasks() -> None:
    """Cancel every task of the running loop but this one, and wait until they are done."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
