"""Block accounting under churn: after many requests with aborts and preemptions every block is free again."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from worker.engine import Engine, EngineConfig, SamplingParams


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_block_is_free_after_1000_requests(tiny_llama: Path, prefix_caching: bool) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=32, max_num_seqs=32,
                                 dtype="float32", max_num_batched_tokens=128, enable_prefix_caching=prefix_caching))
    rng = random.Random(7)
    shared_prefixes = [[rng.randrange(3, 49152) for _ in range(12)] for _ in range(4)]
    live: set[str] = set()
    ended: dict[str, str] = {}
    submitted = 0
    while submitted < 1000 or engine.has_unfinished():
        for _ in range(rng.randint(0, 10)):
            if submitted < 1000:
                prompt = rng.choice(shared_prefixes)[:rng.randint(0, 12)] + [rng.randrange(3, 49152)
                                                                            for _ in range(rng.randint(1, 12))]
                # Mostly greedy: random sampling draws over the whole 49k vocabulary, costly at this volume.
                params = SamplingParams(temperature=1.0 if rng.random() < 0.1 else 0.0,
                                        max_tokens=rng.randint(1, 10), seed=rng.choice([None, submitted]),
                                        ignore_eos=rng.random() < 0.5)
                if submitted % 10 == 5:  # every tenth a beam search: its beams fork, get preempted and aborted together
                    params = dataclasses.replace(params, temperature=0.0, beam_width=rng.randint(2, 3))
                engine.add_request(f"r{submitted}", prompt, params, priority=rng.randint(0, 3))
                live.add(f"r{submitted}")
                submitted += 1
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            assert engine.abort(victim)
            live.discard(victim)
            ended[victim] = "abort"
        for event in engine.step():
            assert event.request_id in live, "event for an ended request"
            if event.finished:
                live.discard(event.request_id)
                ended[event.request_id] = event.finish_reason or ""
    stats = engine.stats()
    assert len(ended) == 1000 and not live
    assert stats.num_preemptions > 0
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert sorted(engine.block_pool.ref_count(b) for b in range(stats.num_total_blocks)) == [0] * 32
    if prefix_caching:
        assert stats.prefix_cache_hits > 0
