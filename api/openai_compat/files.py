"""OpenAI's fine-tuning file formats (purpose `fine-tune`), checked at upload and turned into
this project's rows when a job uses the file (api/openai_compat/jobs.py):

    supervised     {"messages": [{role, content, weight?}], "tools"?}       -> SFT rows {"messages", "tools"?}
                   (weight 0 or 1 on assistant messages, kept: shared/datasets.py `assistant_only`;
                   assistant `tool_calls` and `tool` results as an SFT row has them)
    dpo            {"input": {"messages": [...]}, "preferred_output": [assistant message],
                    "non_preferred_output": [assistant message]}           -> preference rows {prompt, chosen, rejected}
    reinforcement  {"messages": [...], <any other keys>}                   -> GRPO prompt items {prompt: messages, <keys>}

A `messages` file serves supervised and reinforcement jobs alike (which one is the job's
method: a supervised job needs an assistant message in each row, a reinforcement job's prompts
have no tool calls). Errors name the line.
"""

from shared.datasets import DatasetError, messages_row_error, parse_jsonl

PURPOSES = ("fine-tune",)  # what can be uploaded; `fine-tune-results` files are the jobs' own (result_files)
ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_error(m, where: str) -> str | None:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return f"{where} must be an object with role {'|'.join(ROLES)}"
    if not isinstance(m.get("content"), str):
        return f"{where}.content must be a string (content parts and tool calls are not supported)"
    if "weight" in m:
        if m["role"] != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
            return f"{where}.weight must be 0 or 1, on an assistant message"
    return None


def _messages_error(messages, where: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"'{where}' must be a non-empty list of messages"
    for i, m in enumerate(messages):
        if error := _message_error(m, f"{where}[{i}]"):
            return error
    return None


def row_format(row: dict) -> tuple[str, str | None]:
    """(format, why the row does not fit it or None): "preference" or "messages"."""
    if "input" in row or "preferred_output" in row:
        if not isinstance(row.get("input"), dict):
            return "preference", "'input' must be an object {messages}"
        error = _messages_error(row["input"].get("messages"), "input.messages")
        for name in ("preferred_output", "non_preferred_output"):
            out = row.get(name)
            if error is not None:
                break
            if not (isinstance(out, list) and len(out) == 1 and isinstance(out[0], dict)
                    and out[0].get("role") == "assistant"):
                error = f"'{name}' must be a list of one assistant message"
            else:
                error = _message_error(out[0], f"{name}[0]")
        return "preference", error
    if "messages" in row:
        messages = row["messages"]
        roles = isinstance(messages, list) and all(isinstance(m, dict) and m.get("role") in ROLES for m in messages)
        error = messages_row_error({**row, "messages": _plain(messages, weights=True)} if roles else row)
        if error is None and "prompt" in row:
            error = "'prompt' is a reserved key (graders read the row's other keys as item.<key>)"
        return "messages", error
    return "unknown", "no 'messages' (supervised, reinforcement) or 'input'/'preferred_output' (dpo) field"


def check_file(content: bytes, filename: str) -> tuple[list[dict], str]:
    """The rows of an uploaded fine-tune file and their format; DatasetError names the first bad line."""
    rows = parse_jsonl(content, filename)
    lines = [n for n, line in enumerate(content.decode("utf-8").split("\n"), 1) if line.strip()]
    first = None
    for n, row in zip(lines, rows):
        fmt, error = row_format(row)
        if error:
            raise DatasetError(f"{filename} line {n}: {error}")
        if first is not None and fmt != first:
            raise DatasetError(f"{filename} line {n}: a {fmt} row after {first} rows; a file holds one format")
        first = fmt
    return rows, first


METHOD_FORMATS = {"supervised": "messages", "dpo": "preference", "reinforcement": "messages"}


def _plain(messages: list[dict], weights: bool = False) -> list[dict]:
    """Messages as the chat template takes them: developer is system; their weights if `weights`."""
    return [{**{k: v for k, v in m.items() if weights or k != "weight"},
             "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]


def _text(messages: list[dict]) -> str:
    # Preference rows are raw text (shared/datasets.py): the prompt's messages' contents.
    return "\n".join(m["content"] for m in messages)


def to_rows(method: str, rows: list[dict], where: str) -> list[dict]:
    """The file's rows as the method's kind takes them; DatasetError if they do not fit the method."""
    want = METHOD_FORMATS[method]
    out = []
    for i, row in enumerate(rows):
        fmt, error = row_format(row)
        if error or fmt != want:
            raise DatasetError(f"{where} row {i + 1}: {error or f'a {fmt} row; a {method} job needs {want} rows'}")
        if method == "supervised":
            if not any(m["role"] == "assistant" for m in row["messages"]):
                raise DatasetError(f"{where} row {i + 1}: a supervised row needs an assistant message")
            out.append({"messages": _plain(row["messages"], weights=True), **({"tools": row["tools"]} if "tools" in row else {})})
        elif method == "dpo":
            out.append({"prompt": _text(row["input"]["messages"]), "chosen": row["preferred_output"][0]["content"],
                        "rejected": row["non_preferred_output"][0]["content"]})
        else:
            roles = {m["role"] for m in row["messages"]}
            if roles - {"system", "developer", "user", "assistant"} or any("tool_calls" in m for m in row["messages"]):
                raise DatasetError(f"{where} row {i + 1}: reinforcement prompts take system, developer, user and "
                                   "assistant messages, without tool calls")
            extra = {k: v for k, v in row.items() if k != "messages"}
            out.append({"prompt": _plain(row["messages"]), **extra})
    return out
