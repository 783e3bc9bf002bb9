"""OpenAI's Files API for fine-tuning, under /v1 (the official SDK's `client.files`):

    POST   /v1/files                multipart {purpose: "fine-tune", file}: checked, stored -> FileObject
    GET    /v1/files                the token's files, newest first: {object: "list", data, has_more, first_id, last_id}
    GET    /v1/files/{id}           FileObject
    DELETE /v1/files/{id}           {id, object: "file", deleted: true}
    GET    /v1/files/{id}/content   the bytes as uploaded

The storage, quotas, retention and ownership are the dataset files' (api/routes/files.py,
shared/datasets.py): an upload here is usable as a `{"file_id"}` dataset there too. A file is
checked at upload against OpenAI's fine-tuning formats (api/openai_compat/files.py): a 400 names
the first bad line. A job's results file (`file-<job id>`, purpose `fine-tune-results`: its
metrics as CSV) is made from the job's history when asked for.
"""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile, status
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from api.auth import Principal
from api.deps import PrincipalDep, RedisDep, SettingsDep, WriterDep, require_token
from api.openai_compat import jobs as openai_jobs
from api.openai_compat.files import PURPOSES, check_file
from api.openai_errors import ERRORS, OpenAIError, OpenAIRoute
from shared.datasets import DatasetError, QuotaExceeded, delete_file, file_content, owner_files, store_file, visible_file

router = APIRouter(prefix="/v1/files", tags=["OpenAI: files"], dependencies=[Depends(require_token)],
                   route_class=OpenAIRoute, responses=ERRORS)


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def file_object(meta: dict, retention_s: int) -> FileObject:
    return FileObject(id=meta["id"], bytes=meta["bytes"], created_at=int(meta["created_at"]), filename=meta["filename"],
                      purpose=meta.get("purpose", "fine-tune"), expires_at=int(meta["created_at"] + retention_s))


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(status.HTTP_404_NOT_FOUND, f"No such File object: {file_id[:100]}", "id")


def visible_meta(r, file_id: str, who: Principal) -> dict | None:
    """A dataset file this principal may see (an `adapter` upload is the native route's alone:
    OpenAI has no such purpose)."""
    meta = visible_file(r, file_id, who)
    return meta if meta is not None and meta.get("purpose", "fine-tune") in PURPOSES else None


@router.post("", response_model=FileObject, summary="Upload a fine-tuning file (JSON Lines, checked per format)")
async def upload(r: RedisDep, settings: SettingsDep, who: WriterDep, file: Annotated[UploadFile, File()],
                 purpose: Annotated[str, Form()]) -> FileObject:
    if purpose not in PURPOSES:
        raise OpenAIError(400, f"purpose {purpose[:50]!r} is not supported here; use one of {', '.join(PURPOSES)}",
                          "purpose")
    content = await file.read(settings.max_file_bytes + 1)
    if len(content) > settings.max_file_bytes:
        raise OpenAIError(413, f"file larger than {settings.max_file_bytes} bytes (MTQ_MAX_FILE_BYTES)", "file")
    filename = (file.filename or "data.jsonl")[:200]
    try:
        rows, _ = await run_in_threadpool(check_file, content, filename)
        meta = await run_in_threadpool(store_file, r, content, filename, who.name, settings.job_retention_s,
                                       settings.max_files_bytes_per_token, purpose=purpose, rows=len(rows))
    except DatasetError as e:
        raise OpenAIError(400, str(e), "file", "invalid_file_format") from None
    except QuotaExceeded as e:
        raise OpenAIError(413, str(e), "file") from None
    return file_object(meta, settings.job_retention_s)


@router.get("", response_model=FileList, summary="List the token's files, newest first")
def list_files(r: RedisDep, settings: SettingsDep, who: PrincipalDep,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               after: Annotated[str | None, Query(max_length=64)] = None,
               order: Literal["asc", "desc"] = "desc", purpose: Annotated[str | None, Query(max_length=64)] = None,
               ) -> FileList:
    metas = [m for m in owner_files(r, who.name) if m.get("purpose", "fine-tune") in PURPOSES
             and (purpose is None or m.get("purpose", "fine-tune") == purpose)]
    if order == "asc":
        metas.reverse()
    if after is not None:
        ids = [m["id"] for m in metas]
        if after not in ids:
            raise OpenAIError(400, f"unknown file id in 'after': {after}", "after")
        metas = metas[ids.index(after) + 1:]
    data = [file_object(m, settings.job_retention_s) for m in metas[:limit]]
    return FileList(data=data, has_more=len(metas) > limit, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{file_id}", response_model=FileObject, summary="Get a file's object")
def retrieve(file_id: str, r: RedisDep, settings: SettingsDep, who: PrincipalDep) -> FileObject:
    meta = visible_meta(r, file_id, who)
    if meta is None:
        results = openai_jobs.results_file(r, file_id, who.tenant)
        if results is None:
            raise not_found(file_id)
        return FileObject(id=file_id, bytes=len(results.content), created_at=results.created_at,
                          filename=results.filename, purpose="fine-tune-results")
    return file_object(meta, settings.job_retention_s)


@router.delete("/{file_id}", response_model=FileDeleted, summary="Delete a file (a trainer token: its own)")
def delete(file_id: str, r: RedisDep, who: WriterDep) -> FileDeleted:
    meta = visible_meta(r, file_id, who)
    if meta is None:
        raise not_found(file_id)
    delete_file(r, meta)
    return FileDeleted(id=file_id, deleted=True)


@router.get("/{file_id}/content", response_class=Response, summary="A file's bytes as uploaded",
            responses={200: {"content": {"application/octet-stream": {}}}})
def content(file_id: str, r: RedisDep, who: PrincipalDep) -> Response:
    if visible_meta(r, file_id, who) is not None and (data := file_content(r, file_id)) is not None:
        return Response(data, media_type="application/octet-stream")
    results = openai_jobs.results_file(r, file_id, who.tenant)
    if results is None:
        raise not_found(file_id)
    return Response(results.content, media_type="text/csv")
