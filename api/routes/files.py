"""Dataset files: POST /admin/api/fine-tune/files with a JSON Lines body (one row per line),
DELETE /admin/api/fine-tune/files/{file_id}.

Stored in Redis (shared/datasets.py), so every worker reads them without a shared disk; a
job names one as `"dataset": {"file_id": "file-..."}`. A file is its uploader's: another
trainer token's job cannot use it, nor can that token delete it (404). The body is counted
while it is read: past MTQ_MAX_FILE_BYTES the answer is 413, and so it is past the token's
MTQ_MAX_FILES_BYTES_PER_TOKEN of live files. Files expire after MTQ_JOB_RETENTION_S.
"""

import re
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.deps import ADMIN_ERRORS, RedisDep, SettingsDep, WriterDep, require_token
from shared.datasets import FILE_ID, DatasetError, QuotaExceeded, delete_file, file_meta, store_file
from shared.schemas import Deleted, ErrorBody

router = APIRouter(
    prefix="/admin/api/fine-tune/files",
    tags=["Dataset files"],
    dependencies=[Depends(require_token)],
    responses={
        400: {"model": ErrorBody, "description": "Not JSON Lines of objects (the message names the line)."},
        403: {"model": ErrorBody, "description": "A viewer token cannot upload."},
        413: {"model": ErrorBody, "description": "Larger than MTQ_MAX_FILE_BYTES, or the token's files would take more "
              "than MTQ_MAX_FILES_BYTES_PER_TOKEN."},
        **ADMIN_ERRORS,
    },
)


class FileObject(BaseModel):
    id: str
    object: str = "file"
    filename: str
    bytes: int
    rows: int
    created_at: float


@router.post("", response_model=FileObject, summary="Upload a JSON Lines dataset file (raw body)")
async def upload(request: Request, r: RedisDep, settings: SettingsDep, who: WriterDep,
                 filename: Annotated[str, Query(max_length=200)] = "data.jsonl") -> FileObject:
    content = bytearray()
    async for chunk in request.stream():
        content += chunk
        if len(content) > settings.max_file_bytes:
            raise HTTPException(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                                f"file larger than {settings.max_file_bytes} bytes (MTQ_MAX_FILE_BYTES)")
    try:  # in a thread: the event loop never waits on Redis (or on parsing the rows)
        meta = await run_in_threadpool(store_file, r, bytes(content), filename, who.name, settings.job_retention_s,
                                       settings.max_files_bytes_per_token)
    except DatasetError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(e)) from None
    except QuotaExceeded as e:
        raise HTTPException(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, str(e)) from None
    return FileObject(**meta)


@router.delete("/{file_id}", response_model=Deleted, summary="Delete an uploaded file (a trainer token: its own)",
               responses={404: {"model": ErrorBody, "description": "No such file (or not one of this trainer token's)."}})
def delete(file_id: str, r: RedisDep, who: WriterDep) -> Deleted:
    meta = file_meta(r, file_id) if re.fullmatch(FILE_ID, file_id) else None
    if meta is None or not who.sees(meta.get("owner")):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"file not found: {file_id[:100]}")
    delete_file(r, meta)
    return Deleted()
