"""The file resource of the OpenAI Files API (``purpose=batch`` uploads, batch outputs): upload, list, read, delete.

Uploads are capped at ``file_max_bytes`` (413 beyond) and kept ``file_retention_s`` seconds (``expires_at``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response

from api.deps import OwnerDep, ResourcesDep, SettingsDep
from api.errors import APIError, invalid_request
from api.files import FileDeleted, FileList, FileObject, FileStore

router = APIRouter(prefix="/v1/files", tags=["files"])

_CHUNK = 1 << 20


async def get_file_store(resources: ResourcesDep, settings: SettingsDep) -> FileStore:
    return FileStore(resources.redis, settings.file_retention_s)


FileStoreDep = Annotated[FileStore, Depends(get_file_store)]


def file_not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")


@router.post("", response_model=FileObject)
async def upload_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()], store: FileStoreDep,
                      settings: SettingsDep, owner: OwnerDep) -> FileObject:
    """Upload a JSONL file for ``POST /v1/batches`` (only ``purpose=batch`` is served)."""
    if purpose != "batch":
        raise invalid_request(f"purpose must be 'batch', got {purpose!r}", param="purpose",
                              code="invalid_purpose")
    content = bytearray()
    while chunk := await file.read(_CHUNK):
        content += chunk
        if len(content) > settings.file_max_bytes:
            raise APIError(413, f"file larger than the limit of {settings.file_max_bytes} bytes", param="file",
                           code="file_too_large")
    return await store.create(owner, file.filename or "upload.jsonl", "batch", bytes(content))


@router.get("", response_model=FileList)
async def list_files(store: FileStoreDep, owner: OwnerDep, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, after: str | None = None
                     ) -> FileList:
    return await store.list_owned(owner, purpose=purpose, limit=limit, after=after)


@router.get("/{file_id}", response_model=FileObject)
async def retrieve_file(file_id: str, store: FileStoreDep, owner: OwnerDep) -> FileObject:
    found = await store.get(owner, file_id)
    if found is None:
        raise file_not_found(file_id)
    return found


@router.get("/{file_id}/content")
async def file_content(file_id: str, store: FileStoreDep, owner: OwnerDep) -> Response:
    content = await store.content(owner, file_id)
    if content is None:
        raise file_not_found(file_id)
    return Response(content, media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, store: FileStoreDep, owner: OwnerDep) -> FileDeleted:
    if not await store.delete(owner, file_id):
        raise file_not_found(file_id)
    return FileDeleted(id=file_id, deleted=True)
