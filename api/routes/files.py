"""Dataset files: POST /admin/api/fine-tune/files with a JSON Lines body (one row per line).

Stored in Redis (shared/datasets.py), so every worker reads them without a shared disk; a
job names one as `"dataset": {"file_id": "file-..."}`. The body is counted while it is read:
past MTQ_MAX_FILE_BYTES the answer is 413. Files expire after MTQ_JOB_RETENTION_S.
"""

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import BaseModel

from api.deps import ADMIN_ERRORS, RedisDep, SettingsDep, WriterDep, require_token
from shared.datasets import DatasetError, store_file
from shared.schemas import ErrorBody

router = APIRouter(
    prefix="/admin/api/fine-tune/files",
    tags=["Dataset files"],
    dependencies=[Depends(require_token)],
    responses={
        400: {"model": ErrorBody, "description": "Not JSON Lines of objects (the message names the line)."},
        403: {"model": ErrorBody, "description": "A viewer token cannot upload."},
        413: {"model": ErrorBody, "description": "Larger than MTQ_MAX_FILE_BYTES."},
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
    try:
        meta = store_file(r, bytes(content), filename, who.name, settings.job_retention_s)
    except DatasetError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(e)) from None
    return FileObject(**meta)
