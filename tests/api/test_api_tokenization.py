"""ModelCatalog's tokenizer cache: built once per tokenizer, not once per request or per card refresh."""

from __future__ import annotations

import time

from redis.asyncio import Redis
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from api.tokenization import ModelCatalog
from shared import keys
from shared.config import Settings
from shared.queue import JobQueue
from shared.schemas import WorkerInfo
from tests.worker.scripted_engine import model_card


async def publish_card(queue: JobQueue, tokenizer_json: str) -> None:
    await queue.redis.hdel(keys.MODEL_CARDS, "cat-model")  # a worker publishes its card on first registration only
    info = WorkerInfo(id=f"w-{time.monotonic_ns()}", model="cat-model", max_num_seqs=1, num_running=0,
                      num_waiting=0, kv_cache_usage=0.0, heartbeat_at=time.time(), started_at=time.time())
    await queue.register_worker(info, model_card("cat-model").model_copy(update={"tokenizer_json": tokenizer_json}))


async def test_tokenizer_is_rebuilt_only_when_its_json_changes(redis_url: str) -> None:
    async with Redis.from_url(redis_url) as redis:
        queue = JobQueue(redis, Settings(redis_url=redis_url))
        catalog = ModelCatalog(queue, "cat-model", refresh_s=0.0)  # every call re-reads the cards from Redis
        original = model_card().tokenizer_json
        assert original is not None
        await publish_card(queue, original)
        first = await catalog.get("cat-model")
        again = await catalog.get("cat-model")  # a new card object with the same JSON
        assert first is not None and again is not None and first.tokenizer is again.tokenizer
        assert await first.count_prompt_tokens("hello world") == 2

        other = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")).to_str()
        await publish_card(queue, other)
        changed = await catalog.get("cat-model")
        assert changed is not None and changed.tokenizer is not first.tokenizer
        assert await changed.count_prompt_tokens("hello world") == 1  # no pre-tokenizer: one unknown "word"
