"""Queue depth per priority, decoded from the queue's scores (docs/protocol.md, "Queue order")."""

from __future__ import annotations

from queue_helpers import make_job

from shared.queue import JobQueue, priority_of_score


async def test_queue_depth_by_priority_counts_every_priority_present(queue: JobQueue) -> None:
    for p in [-1000, -3, 0, 0, 7, 7, 7, 1000]:
        await queue.submit(make_job(priority=p))
    assert await queue.queue_depth_by_priority("tiny") == {-1000: 1, -3: 1, 0: 2, 7: 3, 1000: 1}
    await queue.claim("tiny", "w", 2)  # the two best: 1000 and one of the 7s
    assert await queue.queue_depth_by_priority("tiny") == {-1000: 1, -3: 1, 0: 2, 7: 2}
    assert await queue.queue_depth_by_priority("nothing-queued") == {}


def test_priority_of_score_inverts_the_submit_formula() -> None:
    for priority in (-1000, -1, 0, 1, 1000):
        for seq in (1, 2**32 - 1):
            assert priority_of_score(-priority * 2**32 + seq) == priority
