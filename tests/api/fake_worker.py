"""A test-only consumer: claims jobs through the real ``JobQueue`` and "generates" text the tests control.

Every generated piece names its position (``"<word>-<k> "``), so a client that got a token twice, lost one or
received them out of order sees different text than ``expected_text`` predicts. It runs in its own thread
and event loop, like a worker process would, so synchronous test clients can block while it works.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import redis.asyncio as aioredis
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from shared.config import Settings
from shared.queue import ClaimedJob, JobQueue
from shared.schemas import (
    Choice,
    FinishReason,
    JobResult,
    JobSubmission,
    ModelCard,
    TokenEvent,
    TokenLogprob,
    Usage,
    WorkerInfo,
)

MODEL = "tiny-test"
MAX_MODEL_LEN = 512
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["[UNK]", "hello", "world", "the", "quick", "brown", "fox", "<|im_start|>", "<|im_end|>", "user",
         "assistant", "system", "<|", "|>", "im_start", "im_end"]


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer: one token per whitespace/punctuation-separated word, so counts are obvious."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer


def model_card(name: str = MODEL, max_model_len: int = MAX_MODEL_LEN) -> ModelCard:
    return ModelCard(name=name, max_model_len=max_model_len, eos_token_ids=[0], chat_template=CHATML,
                     vocab_size=len(WORDS) + 1000, tokenizer_json=word_tokenizer().to_str(),
                     special_tokens={"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})


def source_words(submission: JobSubmission) -> list[str]:
    if submission.prompt is not None:
        text = submission.prompt
    elif submission.messages is not None:
        text = submission.messages[-1].content
    else:
        text = " ".join(f"t{t}" for t in submission.prompt_token_ids or [])
    return text.split() or ["_"]


def piece(words: list[str], k: int, index: int = 0) -> str:
    return f"{words[(k + index) % len(words)]}-{k} "


def expected_text(source: str, max_tokens: int, index: int = 0, stop: tuple[str, ...] = ()) -> str:
    """What the fake worker generates for a prompt whose words are ``source`` (choice ``index``)."""
    words = source.split() or ["_"]
    text = "".join(piece(words, k, index) for k in range(max_tokens))
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text


async def _cancel_until_done(tasks: set[asyncio.Task[None]], attempts: int = 50) -> None:
    """Cancel ``tasks`` and wait for them, re-cancelling the stragglers.

    redis-py can swallow a CancelledError that lands mid-command, so one ``cancel()`` does not reliably end a
    loop that keeps calling Redis; a task left pending when the loop closes never runs its ``finally`` (the
    control channel's pub/sub connection would then be garbage-collected unclosed).
    """
    pending = set(tasks)
    for _ in range(attempts):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    raise RuntimeError(f"{len(pending)} fake-worker tasks ignored {attempts} cancellations")


class FakeWorker:
    """Claims jobs of ``model`` and streams ``expected_text`` at ``token_delay_s`` per token."""

    def __init__(self, redis_url: str, settings: Settings, card: ModelCard | None = None,
                 token_delay_s: float = 0.0, worker_id: str = "fake-worker-1") -> None:
        self.redis_url = redis_url
        self.settings = settings
        self.card = card or model_card()
        self.token_delay_s = token_delay_s
        self.worker_id = worker_id
        self.claimed: list[str] = []
        self.cancelled: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=worker_id, daemon=True)
        self._main: Future[None] | None = None
        self._stop: asyncio.Event | None = None
        self._running: set[asyncio.Task[None]] = set()

    def start(self) -> FakeWorker:
        self._thread.start()
        registered: Future[None] = Future()
        self._main = asyncio.run_coroutine_threadsafe(self._run(registered), self._loop)
        registered.result(timeout=10)
        return self

    def stop(self) -> None:
        if self._main is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._main.result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _run(self, registered: Future[None]) -> None:
        self._stop = asyncio.Event()
        # One task per job, each publishing on its own: more than redis-py's default pool (100) at once.
        client = aioredis.Redis.from_url(self.redis_url, max_connections=1000)
        queue = JobQueue(client, self.settings, poll_interval_s=0.2)
        await queue.register_worker(self._info(), self.card)
        registered.set_result(None)
        tasks = {asyncio.create_task(self._claim_loop(queue)), asyncio.create_task(self._cancel_loop(queue)),
                 asyncio.create_task(self._heartbeat_loop(queue))}
        await self._stop.wait()
        await _cancel_until_done(tasks | self._running)
        await queue.deregister_worker(self.worker_id)
        await client.aclose()

    def _info(self) -> WorkerInfo:
        now = time.time()
        return WorkerInfo(id=self.worker_id, model=self.card.name, max_num_seqs=64, heartbeat_at=now,
                          started_at=now)

    async def _heartbeat_loop(self, queue: JobQueue) -> None:
        assert self._stop is not None
        while not self._stop.is_set():
            await asyncio.sleep(1.0)
            await queue.register_worker(self._info(), self.card)

    async def _cancel_loop(self, queue: JobQueue) -> None:
        async for job_id in queue.cancellations(self.worker_id):
            self.cancelled.add(job_id)

    async def _claim_loop(self, queue: JobQueue) -> None:
        assert self._stop is not None
        running = self._running
        while not self._stop.is_set():
            for job in await queue.claim(self.card.name, self.worker_id, 64):
                self.claimed.append(job.submission.id)
                task = asyncio.create_task(self._generate(queue, job))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.01)

    async def _generate(self, queue: JobQueue, job: ClaimedJob) -> None:
        sub = job.submission
        words = source_words(sub)
        texts = [""] * sub.n
        ids: list[list[int]] = [[] for _ in range(sub.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(sub.n)]
        reasons: list[FinishReason] = ["length"] * sub.n
        seq = 0
        for k in range(sub.params.max_tokens):
            if self._stop is not None and self._stop.is_set():
                return
            if sub.id in self.cancelled:
                reasons = ["abort"] * sub.n
                break
            events = []
            for i in range(sub.n):
                if reasons[i] == "stop":
                    continue
                text, stopped = self._apply_stop(texts[i], piece(words, k, i), sub.params.stop)
                lp = self._logprob(k, text, sub.params.logprobs)
                texts[i] += text
                ids[i].append(k)
                if lp is not None:
                    logprobs[i].append(lp)
                if stopped:
                    reasons[i] = "stop"
                seq += 1
                events.append(TokenEvent(seq=seq, index=i, text=text, token_ids=[k],
                                         logprobs=[lp] if lp is not None else None))
            if events:
                await queue.publish(sub.id, job.fence, events)
            if all(r == "stop" for r in reasons):
                break
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        choices = [Choice(index=i, text=texts[i], finish_reason=reasons[i], token_ids=ids[i],
                          logprobs=logprobs[i] if sub.params.logprobs is not None else None) for i in range(sub.n)]
        usage = Usage(prompt_tokens=len(words), completion_tokens=sum(len(x) for x in ids))
        await queue.complete(sub.id, job.fence, JobResult(choices=choices, usage=usage))

    @staticmethod
    def _apply_stop(so_far: str, text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
        for s in stop:
            combined = so_far + text
            if s in combined:
                return combined[: combined.index(s)][len(so_far):], True
        return text, False

    @staticmethod
    def _logprob(k: int, text: str, top_n: int | None) -> TokenLogprob | None:
        if top_n is None:
            return None
        top = [(k, text, -0.25), (k + 1000, "alt", -1.5), (k + 2000, "other", -2.5)][: top_n]
        return TokenLogprob(token_id=k, token=text, logprob=-0.25, top=top)

