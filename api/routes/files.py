"""Uploaded files: POST /admin/api/fine-tune/files with a raw body, of one of two purposes:

    fine-tune (default)  a dataset: JSON Lines, one row per line; a job names it as `"dataset": {"file_id": ...}`
    adapter              an mlx_lm adapter: adapters.safetensors, or a .tar.gz of an adapter directory (as the
                         download routes give it); a job starts from it with `"init_adapter": {"file_id": ...}`

DELETE /admin/api/fine-tune/files/{file_id}. Stored in Redis (shared/datasets.py), so every
worker reads them without a shared disk. A file is its uploader's: another trainer token's job
cannot use it, nor can that token delete it (404). The body is counted while it is read: past
MTQ_MAX_FILE_BYTES the answer is 413, and so it is past the token's
MTQ_MAX_FILES_BYTES_PER_TOKEN of live files. Files expire after MTQ_JOB_RETENTION_S.
"""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from api.deps import ADMIN_ERRORS, RedisDep, SettingsDep, WriterDep, require_token
from shared.adapters import AdapterFileError, upload_files, upload_summary
from shared.datasets import DatasetError, QuotaExceeded, delete_file, parse_jsonl, store_file, visible_file
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


Purpose = Literal["fine-tune", "adapter"]


class FileObject(BaseModel):
    id: str
    object: str = "file"
    purpose: Purpose = "fine-tune"
    filename: str
    bytes: int
    rows: int | None = Field(None, description="A dataset's rows.")
    adapter: dict[str, Any] | None = Field(None, description="An adapter's shape: tensors, rank, layers (with LoRA), "
                                           "dora, value_head, and its adapter_config.json if it came with one.")
    created_at: float


@router.post("", response_model=FileObject, summary="Upload a JSON Lines dataset or an mlx_lm adapter (raw body)")
async def upload(request: Request, r: RedisDep, settings: SettingsDep, who: WriterDep,
                 filename: Annotated[str, Query(max_length=200)] = "data.jsonl",
                 purpose: Annotated[Purpose, Query(description="fine-tune: a dataset; adapter: an init_adapter.")] = "fine-tune",
                 ) -> FileObject:
    content = bytearray()
    async for chunk in request.stream():
        content += chunk
        if len(content) > settings.max_file_bytes:
            raise HTTPException(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                                f"file larger than {settings.max_file_bytes} bytes (MTQ_MAX_FILE_BYTES)")

    def check_and_store() -> dict:  # in a thread: the event loop never waits on Redis (or on parsing the rows)
        if purpose == "adapter":
            found = {"adapter": upload_summary(upload_files(bytes(content), settings.max_file_bytes))}
        else:
            found = {"rows": len(parse_jsonl(bytes(content), filename or "file"))}
        return store_file(r, bytes(content), filename, who.name, settings.job_retention_s,
                          settings.max_files_bytes_per_token, purpose=purpose, **found)

    try:
        meta = await run_in_threadpool(check_and_store)
    except (DatasetError, AdapterFileError) as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"{filename}: {e}" if purpose == "adapter" else str(e)) from None
    except QuotaExceeded as e:
        raise HTTPException(status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, str(e)) from None
    return FileObject(**meta)


@router.delete("/{file_id}", response_model=Deleted, summary="Delete an uploaded file (a trainer token: its own)",
               responses={404: {"model": ErrorBody, "description": "No such file (or not one of this trainer token's)."}})
def delete(file_id: str, r: RedisDep, who: WriterDep) -> Deleted:
    meta = visible_file(r, file_id, who)
    if meta is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"file not found: {file_id[:100]}")
    delete_file(r, meta)
    return Deleted()
