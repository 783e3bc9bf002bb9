"""Datasets of the supervised kinds, without a shared disk.

A job's `dataset` (and `valid_dataset`) is one of:
  - rows inline in the request: `[{...}, ...]`
  - `{"file_id": "..."}`: a JSON Lines file uploaded with POST /admin/api/fine-tune/files,
    stored in Redis (mtq:file:<id>), so every worker reads it
  - a path on the workers under MTQ_DATA_ROOTS (the seed server's form): an mlx_lm data
    directory (train.jsonl, valid.jsonl) or one .jsonl file

A kind's rows have a format (`RowFormat`), declared by its spec model (`row_format`): SFT's
are mlx_lm's, `{"text"}`, `{"messages": [{role, content}], "tools"?}` or `{"prompt",
"completion"}` (`SFT_ROWS`; messages may be OpenAI's assistant `tool_calls` and `tool` results,
with `weight` 0 or 1 on assistant messages; `assistant_only` says which rows train on their
assistant messages only); the preference kinds' (DPO, ORPO, reward models) are `{"prompt",
"chosen", "rejected"}` (`PREFERENCE_ROWS`); KTO's are `{"prompt", "completion", "label"}`
(shared/train_specs.py `KTO_ROWS`). Errors name the row and the field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from shared.model_ids import under_roots
from shared.schemas import TOO_DEEP, json_size_error
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


class QuotaExceeded(Exception):
    """The token's uploaded files would take more than MTQ_MAX_FILES_BYTES_PER_TOKEN."""


def file_key(file_id: str) -> str:
    return f"mtq:file:{file_id}"


def files_key(owner: str) -> str:
    """Sorted set: "<file id> <bytes>" of each of the token's files -> when it expires (epoch s)."""
    return f"mtq:files-of:{owner}"


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


def _name_error(value, where: str) -> str | None:
    return None if isinstance(value, str) and value else f"'{where}' must be a non-empty string"


def _tool_error(tool, where: str) -> str | None:
    """Why `tools[i]` is not an OpenAI function schema {type: function, function: {name, description?, parameters?}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        return f"'{where}' must be {{type: \"function\", function: {{name, description?, parameters?}}}}"
    function = tool["function"]
    if error := _name_error(function.get("name"), f"{where}.function.name"):
        return error
    if "description" in function and not isinstance(function["description"], str):
        return f"'{where}.function.description' must be a string"
    if "parameters" in function and not isinstance(function["parameters"], dict):
        return f"'{where}.function.parameters' must be an object (a JSON schema)"
    return None


def _tool_call_error(call, where: str) -> str | None:
    """Why an assistant's tool call is not OpenAI's {type?: function, id?, function: {name, arguments}}."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(call.get("function"), dict):
        return f"'{where}' must be {{type: \"function\", function: {{name, arguments}}}}"
    function = call["function"]
    if error := _name_error(function.get("name"), f"{where}.function.name"):
        return error
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"'{where}.function.arguments' is a string but not JSON"
    if not isinstance(arguments, dict):
        return f"'{where}.function.arguments' must be an object or a JSON string of one"
    return None


def _message_error(m, where: str) -> str | None:
    """Why one message of an SFT row is not {role, content}, an assistant's {role, content?,
    tool_calls} or a tool result {role: tool, content, tool_call_id?, name?}, with weight 0 or
    1 on assistant messages only."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return f"'{where}' must be {{role: {'|'.join(ROLES)}, content: string}}"
    if "tool_calls" in m:
        if m["role"] != "assistant":
            return f"'{where}.tool_calls': only assistant messages call tools"
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not calls:
            return f"'{where}.tool_calls' must be a non-empty list"
        if error := next((e for j, c in enumerate(calls) if (e := _tool_call_error(c, f"{where}.tool_calls[{j}]"))), None):
            return error
        if m.get("content") is not None and not isinstance(m["content"], str):
            return f"'{where}.content' must be a string or null"
    elif not isinstance(m.get("content"), str):
        return f"'{where}' must be {{role: {'|'.join(ROLES)}, content: string}}"
    if m["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if key in m and (error := _name_error(m[key], f"{where}.{key}")):
                return error
    if "weight" in m and (m["role"] != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool)):
        return f"'{where}.weight' must be 0 or 1, on an assistant message"
    return None


def messages_row_error(row: dict) -> str | None:
    """Why a {messages, tools?} row is not a conversation an SFT job trains on (OpenAI's
    supervised files' rows too: api/openai_compat/files.py)."""
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    if error := next((e for i, m in enumerate(messages) if (e := _message_error(m, f"messages[{i}]"))), None):
        return error
    if "tools" in row:
        if not isinstance(row["tools"], list):
            return "'tools' must be a list"
        return next((e for i, t in enumerate(row["tools"]) if (e := _tool_error(t, f"tools[{i}]"))), None)
    return None


def sft_row_error(row: dict) -> str | None:
    if "messages" in row:
        return messages_row_error(row)
    if "prompt" in row or "completion" in row:
        return _text(row, "prompt") or _text(row, "completion")
    if "text" in row:
        return _text(row, "text")
    return "no 'text', 'messages' or 'prompt'/'completion' field (mlx_lm's formats)"


def assistant_only(row: dict, assistant_only_loss: bool | None) -> bool:
    """Whether a row's loss is on its assistant messages only: a messages row's, as
    assistant_only_loss says (None: for the rows that have tools, tool calls or results,
    weights or more than one assistant message; the others are mlx_lm's, as mask_prompt says)."""
    if "messages" not in row or assistant_only_loss is False:
        return False
    messages = row["messages"]
    return bool(assistant_only_loss or row.get("tools") or sum(m["role"] == "assistant" for m in messages) > 1
                or any(m["role"] == "tool" or "tool_calls" in m or "weight" in m for m in messages))


def sft_loss_error(row: dict, assistant_only_loss: bool | None) -> str | None:
    """Why a (well-formed) SFT row cannot be trained with this assistant_only_loss."""
    if assistant_only_loss and "messages" not in row:
        return "assistant_only_loss needs messages rows (mask_prompt masks a prompt/completion row's prompt)"
    messages = row.get("messages", [])
    if not assistant_only(row, assistant_only_loss):
        if any(m.get("weight") == 0 for m in messages):
            return "weight 0 needs assistant_only_loss (false here: the message would be trained)"
        return None
    if messages[0]["role"] == "assistant":
        return "the first message is the assistant's: its prompt would be an empty conversation, which chat templates refuse"
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        return "no assistant message of weight 1: the row would train no token"
    return None


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
    # Lines end at \n only (JSON Lines): str.splitlines would also cut at U+2028, U+0085... which
    # a JSON string may hold as they are.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except RecursionError:
            raise DatasetError(f"{where} line {n}: {TOO_DEEP}") from None
        except ValueError as e:
            raise DatasetError(f"{where} line {n}: not JSON ({e})"[:300]) from None
        if error := json_size_error(row):
            raise DatasetError(f"{where} line {n}: {error}")
        if not isinstance(row, dict):
            raise DatasetError(f"{where} line {n}: a row must be a JSON object")
        rows.append(row)
    if not rows:
        raise DatasetError(f"{where}: no rows")
    return rows


def store_file(r: redis.Redis, content: bytes, filename: str, owner: str | None, retention_s: int,
               quota: int | None = None, **fields: Any) -> dict:
    """Store an uploaded file with its metadata (fields: what its purpose's check found: a
    dataset's `rows`, an adapter's `adapter` summary). Returns the metadata. QuotaExceeded when
    the owner's live files and this one would take more than `quota` bytes."""
    from redis import WatchError  # here, as in shared/adapters.py: the trainers import this module without redis

    file_id = f"file-{uuid.uuid4().hex}"
    meta = {"id": file_id, "object": "file", "filename": filename, "bytes": len(content), "created_at": time.time(),
            "owner": owner, **fields}
    with r.pipeline() as p:
        while True:
            try:
                if owner is not None:  # the owner's files, counted under WATCH: two uploads cannot both fit
                    p.watch(files_key(owner))
                    used = sum(int(m.rsplit(b" ", 1)[1]) for m in p.zrangebyscore(files_key(owner), meta["created_at"], "+inf"))
                    if quota is not None and used + len(content) > quota:
                        raise QuotaExceeded(f"{owner!r}'s files take {used} bytes; with these {len(content)} that is more "
                                            f"than {quota} (MTQ_MAX_FILES_BYTES_PER_TOKEN); delete some first")
                p.multi()
                p.hset(file_key(file_id), mapping={"content": content, "meta": json.dumps(meta)})
                p.expire(file_key(file_id), retention_s)
                if owner is not None:
                    p.zremrangebyscore(files_key(owner), "-inf", meta["created_at"])
                    p.zadd(files_key(owner), {f"{file_id} {len(content)}": meta["created_at"] + retention_s})
                    p.expire(files_key(owner), retention_s)
                p.execute()
                return meta
            except WatchError:
                continue


def delete_file(r: redis.Redis, meta: dict) -> None:
    """Delete an uploaded file (its metadata as file_meta gives it), freeing its owner's quota."""
    with r.pipeline() as p:
        p.delete(file_key(meta["id"]))
        if meta.get("owner") is not None:
            p.zrem(files_key(meta["owner"]), f"{meta['id']} {meta['bytes']}")
        p.execute()


def owner_files(r: redis.Redis, owner: str) -> list[dict]:
    """The metadata of the owner's live files, newest first."""
    members = r.zrangebyscore(files_key(owner), time.time(), "+inf")
    with r.pipeline() as p:
        for m in members:
            p.hget(file_key(m.decode().split(" ")[0]), "meta")
        metas = [json.loads(raw) for raw in p.execute() if raw is not None]
    return sorted(metas, key=lambda m: m["created_at"], reverse=True)


def file_content(r: redis.Redis, file_id: str) -> bytes | None:
    return r.hget(file_key(file_id), "content")


def file_meta(r: redis.Redis, file_id: str) -> dict | None:
    raw = r.hget(file_key(file_id), "meta")
    return None if raw is None else json.loads(raw)


def visible_file(r: redis.Redis, file_id: str, who) -> dict | None:
    """The file's metadata if `file_id` names one and `who` (a principal: `who.sees(owner)`) may
    see it; None otherwise, so that another trainer's file reads as missing."""
    meta = file_meta(r, file_id) if re.fullmatch(FILE_ID, file_id) else None
    return meta if meta is not None and who.sees(meta.get("owner")) else None


# --------------------------------------------------------------------------- resolving a reference


SPLITS = ("train", "valid")  # a data directory's files: <split>.jsonl


def path_error(path: str, settings: Settings) -> str | None:
    """Why a dataset path may not be used (None if it may): it must be absolute and under
    MTQ_DATA_ROOTS, and so must each file it names once every symlink is followed (a data
    directory's train.jsonl may be a link to anywhere)."""
    if not settings.data_roots:
        return (f"dataset path {path[:200]!r}: this server reads datasets from paths only under MTQ_DATA_ROOTS, "
                "and none is configured; send the rows inline or upload a file (POST /admin/api/fine-tune/files)")
    if not path.startswith("/") or "\x00" in path:
        return f"dataset path {path[:200]!r} is not under MTQ_DATA_ROOTS"
    p = Path(path).resolve()
    files = [p / f"{split}.jsonl" for split in SPLITS] if p.is_dir() else []
    if not all(under_roots(f.resolve(), settings.data_roots) for f in [p, *files]):
        return f"dataset path {path[:200]!r} is not under MTQ_DATA_ROOTS"
    return None


def _path_rows(path: str, settings: Settings, split: str) -> list[dict] | None:
    if error := path_error(path, settings):
        raise DatasetError(error)
    p = Path(path).resolve()
    if p.is_dir():
        p = (p / f"{split}.jsonl").resolve()
        if not under_roots(p, settings.data_roots):  # as path_error found it, unless it changed since
            raise DatasetError(f"dataset path {path!r} is not under MTQ_DATA_ROOTS")
        if not p.is_file():
            if split == "train":
                raise DatasetError(f"dataset directory {path!r} has no train.jsonl")
            return None
    elif not p.is_file():
        raise DatasetError(f"dataset path {path!r} does not exist on this worker")
    return parse_jsonl(p.read_bytes(), f"{path} ({p.name})")


def load_rows(r: redis.Redis, ref: DatasetRef | None, settings: Settings, row_format: RowFormat, where: str,
              split: str = "train", tenant: str | None = None) -> list[dict] | None:
    """The rows a reference names, checked against the format (DatasetError otherwise).
    None: no reference (or a data directory without that split). tenant: a trainer's job may
    read only that trainer's files (another's reads as missing)."""
    if ref is None:
        return None
    if isinstance(ref, list):
        rows = ref
    elif isinstance(ref, FileRef):
        content, meta = r.hmget(file_key(ref.file_id), "content", "meta")
        if content is None or (tenant is not None and json.loads(meta).get("owner") != tenant):
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
