"""The batch resource of the OpenAI Batch API: create (validating the input file first), read, list, cancel.

A batch is validated inside ``POST /v1/batches``: the answer is the batch ``in_progress`` or ``failed`` with its
``errors``. Its lines then run as ordinary jobs at ``batch_priority``, advanced by every API replica's runner.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from api.batches.models import Batch, BatchCreate, BatchErrors, BatchList, RequestCounts
from api.batches.store import BatchStore, new_batch_id
from api.batches.validation import LineContext, validate_file
from api.deps import CatalogDep, OwnerDep, ResourcesDep, SettingsDep
from api.errors import APIError
from api.files import FileStore
from api.routes.files import file_not_found
from api.webhooks.outbox import WebhookOutbox, check_callback_url

router = APIRouter(prefix="/v1/batches", tags=["batches"])


async def get_batch_store(resources: ResourcesDep, settings: SettingsDep) -> BatchStore:
    return BatchStore(resources.redis, settings.file_retention_s)


BatchStoreDep = Annotated[BatchStore, Depends(get_batch_store)]


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")


@router.post("", response_model=Batch)
async def create_batch(body: BatchCreate, store: BatchStoreDep, resources: ResourcesDep, settings: SettingsDep,
                       catalog: CatalogDep, owner: OwnerDep) -> Batch:
    """Validate the input file and start the batch (``in_progress``), or answer it ``failed`` with its errors."""
    check_callback_url(settings, body.webhook_url, param="webhook_url")
    files = FileStore(resources.redis, settings.file_retention_s)
    input_file = await files.get(owner, body.input_file_id)
    content = await files.content(owner, body.input_file_id) if input_file is not None else None
    if input_file is None or content is None:
        raise file_not_found(body.input_file_id)
    if input_file.purpose != "batch":
        raise APIError(400, f"file {body.input_file_id} has purpose {input_file.purpose!r}, not 'batch'",
                       param="input_file_id", code="invalid_file_purpose")
    batch_id = new_batch_id()
    now = int(time.time())
    common = {"id": batch_id, "endpoint": body.endpoint, "input_file_id": body.input_file_id,
              "completion_window": body.completion_window, "created_at": now, "metadata": body.metadata}
    validated = await validate_file(content, LineContext(batch_id, body.endpoint, owner, settings, catalog,
                                                             resources.queue))
    if validated.errors:
        batch = Batch(**common, status="failed", failed_at=now, errors=BatchErrors(data=validated.errors))
        await store.create(batch, owner, [], body.webhook_url)
        state = await store.state(batch_id)
        assert state is not None
        await WebhookOutbox(resources.redis, settings).batch_event(state)
        return batch
    batch = Batch(**common, status="in_progress", in_progress_at=now,
                  expires_at=now + settings.batch_window_s,
                  model=validated.lines[0].submission.model, request_counts=RequestCounts(total=len(validated.lines)))
    await store.create(batch, owner, validated.lines, body.webhook_url)
    return batch


@router.get("", response_model=BatchList)
async def list_batches(store: BatchStoreDep, owner: OwnerDep, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    """The caller's batches, newest first; page with ``after`` (the last id of the previous page)."""
    batches, has_more = await store.list_owned(owner, after, limit)
    return BatchList(data=batches, first_id=batches[0].id if batches else None,
                     last_id=batches[-1].id if batches else None, has_more=has_more)


@router.get("/{batch_id}", response_model=Batch)
async def retrieve_batch(batch_id: str, store: BatchStoreDep, owner: OwnerDep) -> Batch:
    state = await store.get(owner, batch_id)
    if state is None:
        raise batch_not_found(batch_id)
    return state.batch


@router.post("/{batch_id}/cancel", response_model=Batch)
async def cancel_batch(batch_id: str, store: BatchStoreDep, owner: OwnerDep) -> Batch:
    """Cancel: the batch turns ``cancelling`` (its queued lines are cancelled and its running ones aborted by the
    runner), then ``cancelled`` with the results it has. A finished batch answers 409."""
    state = await store.get(owner, batch_id)
    if state is None:
        raise batch_not_found(batch_id)
    if state.batch.status in ("completed", "failed", "expired"):
        raise APIError(409, f"Cannot cancel a batch with status '{state.batch.status}'.", type="invalid_request_error",
                       code="batch_not_cancellable")
    await store.stop(batch_id, "batch_cancelled", "cancelling", "cancelling_at", int(time.time()))
    after = await store.get(owner, batch_id)
    assert after is not None
    return after.batch
