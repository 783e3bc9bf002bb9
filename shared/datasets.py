"""Datasets of the supervised kinds, without a shared disk.

A job's `dataset` (and `valid_dataset`) is one of:
  - rows inline in the request: `[{...}, ...]`
  - `{"file_id": "..."}`: a JSON Lines file uploaded with POST /admin/api/fine-tune/files,
    stored in Redis (mtq:file:<id>), so every worker reads it
  - a path on the workers under MTQ_DATA_ROOTS (the seed server's form): an mlx_lm data
    directory (train.jsonl, valid.jsonl) or one .jsonl file

A kind's rows have a format (`RowFormat`), declared by its spec model (`row_format`): SFT's
are mlx_lm's, `{"text"}`, `{"messages": [{role, content}], "tools"?}` or `{"prompt",
"completion"}` (`SFT_ROWS`); the preference kinds' (DPO, ORPO, reward models) are `{"prompt",
"chosen", "rejected"}` (`PREFERENCE_ROWS`). Errors name the row and the field.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from shared.model_ids import under_roots
from shared.settings import Settings

if TYPE_CHECKING:  # the trainers import the row checks here and need no Redis client
    import redis

FILE_ID = r"^file-[0-9a-f]{32}$"
ROLES = ("system", "user", "assistant", "tool")


class PreferencePair(BaseModel):
    model_config = ConfigDict(extra="allow")  # other columns are kept, as the seed server keeps them
    prompt: str = Field(..., min_length=1)
    chosen: str = Field(..., min_length=1)
    rejected: str = Field(..., min_length=1)


class FileRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file_id: str = Field(..., pattern=FILE_ID)


DatasetRef = list[dict[str, Any]] | FileRef | str


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the row and the field."""


def file_key(file_id: str) -> str:
    return f"mtq:file:{file_id}"


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class RowFormat:
    """How a kind's rows look: `row_error(row)` says why one row (a JSON object) does not fit,
    `rows_error(rows)` why the rows together do not (None: they do)."""

    row_error: Callable[[dict], str | None]
    rows_error: Callable[[list[dict]], str | None] = lambda rows: None


def fields_error(row: dict, fields: dict[str, type], shape: str) -> str | None:
    """Why a row lacks one of `fields` or has one of another type (a str must not be empty);
    shape: the format in words, e.g. 'preference rows are {prompt, chosen, rejected}'."""
    missing = [k for k in fields if k not in row]
    if missing:
        return f"missing field '{missing[0]}' ({shape})"
    for name, kind in fields.items():
        if kind is str and (error := _text(row, name)):
            return error
        if kind is bool and not isinstance(row[name], bool):
            return f"'{name}' must be true or false"
    return None


def _text(row: dict, name: str) -> str | None:
    value = row.get(name)
    if not isinstance(value, str):
        return f"'{name}' must be a string"
    return None if value else f"'{name}' is empty"


def sft_row_error(row: dict) -> str | None:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                return f"'messages[{i}]' must be {{role: {'|'.join(ROLES)}, content: string}}"
        if "tools" in row and not isinstance(row["tools"], list):
            return "'tools' must be a list"
        return None
    if "prompt" in row or "completion" in row:
        return _text(row, "prompt") or _text(row, "completion")
    if "text" in row:
        return _text(row, "text")
    return "no 'text', 'messages' or 'prompt'/'completion' field (mlx_lm's formats)"


def sft_format(row: dict) -> str:
    return "messages" if "messages" in row else "completions" if "prompt" in row else "text"


def one_sft_format(rows: list[dict]) -> str | None:
    formats = {sft_format(r) for r in rows}
    return f"rows mix formats ({', '.join(sorted(formats))}); use one" if len(formats) > 1 else None


SFT_ROWS = RowFormat(sft_row_error, one_sft_format)
PREFERENCE_ROWS = RowFormat(lambda row: fields_error(row, {"prompt": str, "chosen": str, "rejected": str},
                                                     "preference rows are {prompt, chosen, rejected}"))


def rows_errors(row_format: RowFormat, rows: list, where: str) -> list[str]:
    errors = [f"{where}[{i}]: {e}" for i, row in enumerate(rows)
              if (e := "a row must be a JSON object" if not isinstance(row, dict) else row_format.row_error(row))]
    if not errors and rows and (error := row_format.rows_error(rows)):
        errors.append(f"{where}: {error}")
    if not rows:
        errors.append(f"{where}: no rows")
    return errors


# --------------------------------------------------------------------------- JSON Lines


def parse_jsonl(content: bytes, where: str) -> list[dict]:
    """Rows of a JSON Lines text (blank lines skipped). DatasetError names the line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{where} line {n}: not JSON ({e})"[:300]) from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where} line {n}: a row must be a JSON object")
        rows.append(row)
    if not rows:
        raise DatasetError(f"{where}: no rows")
    return rows


def store_file(r: redis.Redis, content: bytes, filename: str, owner: str | None, retention_s: int,
               **fields: Any) -> dict:
    """Store an uploaded file with its metadata (fields: what its purpose's check found: a
    dataset's `rows`, an adapter's `adapter` summary). Returns the metadata."""
    file_id = f"file-{uuid.uuid4().hex}"
    meta = {"id": file_id, "object": "file", "filename": filename, "bytes": len(content), "created_at": time.time(),
            "owner": owner, **fields}
    with r.pipeline() as p:
        p.hset(file_key(file_id), mapping={"content": content, "meta": json.dumps(meta)})
        p.expire(file_key(file_id), retention_s)
        p.execute()
    return meta


def file_meta(r: redis.Redis, file_id: str) -> dict | None:
    raw = r.hget(file_key(file_id), "meta")
    return None if raw is None else json.loads(raw)


# --------------------------------------------------------------------------- resolving a reference


def path_error(path: str, settings: Settings) -> str | None:
    """Why a dataset path may not be used (None if it may): it must be absolute and under MTQ_DATA_ROOTS."""
    if not settings.data_roots:
        return (f"dataset path {path[:200]!r}: this server reads datasets from paths only under MTQ_DATA_ROOTS, "
                "and none is configured; send the rows inline or upload a file (POST /admin/api/fine-tune/files)")
    if not path.startswith("/") or "\x00" in path or not under_roots(Path(path).resolve(), settings.data_roots):
        return f"dataset path {path[:200]!r} is not under MTQ_DATA_ROOTS"
    return None


def _path_rows(path: str, settings: Settings, split: str) -> list[dict] | None:
    if error := path_error(path, settings):
        raise DatasetError(error)
    p = Path(path).resolve()
    if p.is_dir():
        p = p / f"{split}.jsonl"
        if not p.is_file():
            if split == "train":
                raise DatasetError(f"dataset directory {path!r} has no train.jsonl")
            return None
    elif not p.is_file():
        raise DatasetError(f"dataset path {path!r} does not exist on this worker")
    return parse_jsonl(p.read_bytes(), f"{path} ({p.name})")


def load_rows(r: redis.Redis, ref: DatasetRef | None, settings: Settings, row_format: RowFormat, where: str,
              split: str = "train") -> list[dict] | None:
    """The rows a reference names, checked against the format (DatasetError otherwise).
    None: no reference (or a data directory without that split)."""
    if ref is None:
        return None
    if isinstance(ref, list):
        rows = ref
    elif isinstance(ref, FileRef):
        content = r.hget(file_key(ref.file_id), "content")
        if content is None:
            raise DatasetError(f"{where}: file {ref.file_id} not found (uploads expire after MTQ_JOB_RETENTION_S)")
        rows = parse_jsonl(content, f"{where} (file {ref.file_id})")
    else:
        rows = _path_rows(ref, settings, split)
        if rows is None:
            return None
    errors = rows_errors(row_format, rows, where)
    if errors:
        raise DatasetError("; ".join(errors[:5]))
    return rows
