"""The client commands (`mtq submit`, `jobs`, `show`, `watch`, `logs`, `cancel`, `resume`,
`download`, `export`, `plot`): the REST API over HTTP (cli/client.py), MTQ_API_URL and MTQ_API_TOKEN.
`submit` takes any kind of the registry (shared/kinds.py); the others take a job of any kind
by its id. They never import the worker or mlx."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Column, Table

from cli.client import ApiClient, ApiError
from cli.plot import plot
from cli.watch import watch
from shared.kinds import DEFAULT, KINDS

console = Console(highlight=False)


def parse_value(text: str) -> Any:
    """A --set value: JSON when it parses (numbers, true/false, null, lists), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--set wants key=value, got {pair!r}")
        out[key.strip()] = parse_value(value)
    return out


def read_prompts(client: ApiClient, path: Path) -> list:
    """A JSON list, or one prompt per line of text."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return [line for line in text.splitlines() if line.strip()]


def read_pairs(client: ApiClient, path: Path) -> list:
    """A JSON list, or JSON Lines (one pair per line)."""
    text = path.read_text()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    try:
        return value if isinstance(value, list) else [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise ApiError(0, f"{path}: neither a JSON list nor JSON Lines ({e})") from None


def upload_dataset(client: ApiClient, path: Path) -> dict:
    return {"file_id": client.upload(path)}


# The spec field each file flag fills, and how: a flag is for the kinds whose spec has the field.
FILE_FLAGS = {"prompts": ("--prompts", read_prompts), "preference_pairs": ("--pairs", read_pairs),
              "dataset": ("--dataset", upload_dataset)}


def build_spec(client: ApiClient, args: argparse.Namespace) -> dict:
    """The body of the kind's POST: FILE.json changed by the flags (--dataset is uploaded)."""
    kind = KINDS[args.kind]
    fields = kind.spec_model.model_fields
    spec: dict[str, Any] = json.loads(Path(args.file).read_text()) if args.file else {}
    given = {field: getattr(args, field) for field in FILE_FLAGS if getattr(args, field)}
    wrong = [FILE_FLAGS[field][0] for field in given if field not in fields]
    if wrong:
        takes = [flag for field, (flag, _) in FILE_FLAGS.items() if field in fields]
        raise ApiError(0, f"{', '.join(wrong)}: not for {kind.name} jobs (they take {', '.join(takes) or 'FILE.json'})")
    if args.model:
        spec["model_id"] = args.model
    if args.adapter_name:
        spec["adapter_name"] = args.adapter_name
    if args.teacher:
        if "teacher_model_id" not in fields:
            raise ApiError(0, f"--teacher: not for {kind.name} jobs (GKD's teacher_model_id)")
        spec["teacher_model_id"] = args.teacher
    if args.set:
        spec["config"] = {**spec.get("config", {}), **parse_sets(args.set)}
    missing = [name for name, info in fields.items() if info.is_required() and name not in spec and name not in given]
    if missing:
        raise ApiError(0, f"the job needs {' and '.join(missing)} (from FILE.json, --model, "
                          f"{'--teacher, ' if 'teacher_model_id' in fields else ''}"
                          f"{', '.join(flag for field, (flag, _) in FILE_FLAGS.items() if field in fields)})")
    for field, path in given.items():
        spec[field] = FILE_FLAGS[field][1](client, Path(path))
    return spec


def cmd_submit(client: ApiClient, args: argparse.Namespace) -> int:
    kind = KINDS[args.kind]
    job = client.submit(kind, build_spec(client, args))
    console.print(f"submitted job [bold]{job['job_id']}[/] ({kind.name}, {job['status']})")
    if args.watch:
        return watch(client, job["job_id"], console)
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%m-%d %H:%M", time.localtime(ts)) if ts else ""


def cmd_jobs(client: ApiClient, args: argparse.Namespace) -> int:
    jobs = client.list_jobs(status=args.status, limit=args.limit)
    # The id whole, however narrow the terminal: it is what the other commands take.
    table = Table(Column("job", no_wrap=True, min_width=32), "kind", Column("status", no_wrap=True), "phase", "step",
                  "metric", "model", "created", box=None)
    for job in jobs:
        p = job.get("progress") or {}
        kind = KINDS.get(job.get("kind"))  # None: a record this version cannot read
        value = p.get(kind.headline) if kind else None
        step = f"{p.get('iter', 0)}/{p['total_iters']}" if p.get("total_iters") else ""
        table.add_row(job["job_id"], job.get("kind", ""), job["status"], job.get("phase") or "", step,
                      "" if value is None else f"{kind.headline} {value:.4g}", job.get("model_id", ""),
                      _when(job.get("created_at")))
    console.print(table)
    return 0


def cmd_show(client: ApiClient, args: argparse.Namespace) -> int:
    console.print_json(json.dumps(client.job(args.job_id)))
    return 0


def event_line(event_id: str | None, event: dict) -> str:
    """One line per event: its time (from the stream id), its type, then its fields."""
    when = time.strftime("%H:%M:%S", time.localtime(int(event_id.split("-")[0]) / 1000)) if event_id else "--:--:--"
    fields = " ".join(f"{k}={_short(v)}" for k, v in event.items() if k != "type")
    return f"{when} {event.get('type', '?'):<12} {fields}"


def _short(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 120 else text[:117] + "..."


def cmd_logs(client: ApiClient, args: argparse.Namespace) -> int:
    for event_id, event in client.events(args.job_id, follow=args.follow):
        print(event_line(event_id, event), flush=True)
    return 0


def cmd_cancel(client: ApiClient, args: argparse.Namespace) -> int:
    job = client.cancel(args.job_id)
    console.print(f"job {args.job_id}: {job['status']}" +
                  (" (cancel requested; it stops at its next step)" if job["status"] == "running" else ""))
    return 0


def cmd_resume(client: ApiClient, args: argparse.Namespace) -> int:
    job = client.resume(args.job_id, parse_sets(args.set or []))
    console.print(f"job {args.job_id}: {job['status']} (continues from step {job.get('checkpoint_step') or 0})")
    return 0


def cmd_watch(client: ApiClient, args: argparse.Namespace) -> int:
    return watch(client, args.job_id, console)


def cmd_download(client: ApiClient, args: argparse.Namespace) -> int:
    download = client.download_tensorboard if args.tensorboard else client.download_adapter
    for path in download(args.job_id, Path(args.dir)):
        console.print(str(path))
    return 0


def cmd_export(client: ApiClient, args: argparse.Namespace) -> int:
    """An export job of the job's adapter (docs/export.md), followed as `mtq watch` does, its model
    directory then unpacked into DIR. The exit code is watch's when the export does not complete."""
    kind = KINDS["export"]
    body = {"source": args.job_id, "dequantize": args.dequantize, "gguf": args.gguf}
    if args.quantize:
        body.update(quantize=True, quant_bits=args.quant_bits, quant_mode=args.quant_mode)
    job = client.submit(kind, body)
    console.print(f"submitted export job [bold]{job['job_id']}[/] of job {job['source']} ({job['model_id']})")
    code = watch(client, job["job_id"], console)
    if code:
        return code
    for path in client.download_adapter(job["job_id"], Path(args.dir)):
        console.print(str(path))
    return 0


def cmd_plot(client: ApiClient, args: argparse.Namespace) -> int:
    steps = client.step_metrics(args.job_id)
    if not steps:
        raise ApiError(0, f"job {args.job_id} has no steps yet")
    job, kind = client.job(args.job_id), client.kind_of(args.job_id)
    out = plot(steps, Path(args.out or f"{args.job_id}.png"),
               f"job {args.job_id} ({kind.name}, {job['model_id']}, {job['status']})", kind.charts)
    console.print(f"wrote {out} ({len(steps)} points)")  # a step each, and an evaluation before the first
    return 0


def cmd_chat(client: ApiClient, args: argparse.Namespace) -> int:
    """A conversation in the terminal (each line a user message; /exit or end of input ends it),
    or one answer with -p. The reply streams as the worker decodes it."""
    model, adapter = client.chat_model(args.model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    params = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        reply = []
        for piece in client.chat(model, messages, adapter, **params):
            sys.stdout.write(piece)
            sys.stdout.flush()
            reply.append(piece)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})

    if args.prompt is not None:
        turn(args.prompt)
        return 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip():
            turn(line)


def run_client_command(func, args: argparse.Namespace) -> int:
    client = ApiClient.from_env()
    try:
        return func(client, args)
    except ApiError as e:
        Console(stderr=True, highlight=False).print(f"[red]error:[/] {e.detail if e.status == 0 else e}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def add_client_commands(commands) -> None:
    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help_text)
        parser.set_defaults(func=lambda args: run_client_command(func, args))
        return parser

    submit = add("submit", cmd_submit, "submit a job of any kind (JSON body as for its POST route, and/or flags)")
    submit.add_argument("file", metavar="FILE.json", nargs="?", help="the job's body: {model_id, config, ...}")
    submit.add_argument("--kind", choices=list(KINDS), default=DEFAULT.name, help="default: %(default)s")
    submit.add_argument("--model", help="model_id")
    submit.add_argument("--prompts", metavar="FILE", help="GRPO's prompts: a JSON list, or one per line of text")
    submit.add_argument("--dataset", metavar="FILE", help="training rows, JSON Lines: uploaded, then the job's "
                        "dataset {\"file_id\"} (the supervised kinds)")
    submit.add_argument("--pairs", dest="preference_pairs", metavar="FILE",
                        help="preference pairs {prompt, chosen, rejected}: a JSON list or JSON Lines (DPO, ORPO, reward)")
    submit.add_argument("--adapter-name")
    submit.add_argument("--teacher", metavar="MODEL_ID", help="GKD's teacher_model_id")
    submit.add_argument("--set", nargs="+", metavar="KEY=VALUE", help="config fields, e.g. iters=20 learning_rate=5e-6")
    submit.add_argument("--watch", action="store_true", help="then follow it as `mtq watch` does")

    jobs = add("jobs", cmd_jobs, "list jobs, newest first")
    jobs.add_argument("--status", choices=["queued", "running", "completed", "failed", "cancelled"])
    jobs.add_argument("--limit", type=int, default=50)

    for name, func, help_text in [
        ("show", cmd_show, "print a job as JSON"),
        ("watch", cmd_watch, "a live progress bar until the job ends (exit 0 completed, 1 failed, 2 cancelled)"),
        ("cancel", cmd_cancel, "cancel a job"),
    ]:
        add(name, func, help_text).add_argument("job_id", metavar="ID")

    logs = add("logs", cmd_logs, "print a job's events, one per line")
    logs.add_argument("job_id", metavar="ID")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")

    resume = add("resume", cmd_resume, "re-queue a failed or cancelled job from its last checkpoint")
    resume.add_argument("job_id", metavar="ID")
    resume.add_argument("--set", nargs="+", metavar="KEY=VALUE", help="config changes, e.g. learning_rate=5e-6")

    download = add("download", cmd_download, "download a completed job's adapter into DIR")
    download.add_argument("job_id", metavar="ID", help="a job id, an OpenAI job id (ftjob-...) or fine-tuned model (ft:...)")
    download.add_argument("dir", metavar="DIR")
    download.add_argument("--tensorboard", action="store_true",
                          help="its TensorBoard event files instead (a job with report_to tensorboard: docs/trackers.md)")

    chat = add("chat", cmd_chat, "chat with a trained model in the terminal (or one answer with -p)")
    chat.add_argument("model", metavar="JOB_OR_MODEL", help="a job id, an OpenAI job id (ftjob-...), a fine-tuned "
                      "model (ft:...) or a base model id")
    chat.add_argument("-p", "--prompt", help="ask this, print the answer and exit")
    chat.add_argument("--system", help="a system message first")
    chat.add_argument("--max-tokens", type=int)
    chat.add_argument("--temperature", type=float)

    export = add("export", cmd_export, "fuse a completed job's adapter into its base model (on a worker) and "
                 "download the model directory into DIR")
    export.add_argument("job_id", metavar="JOB", help="a job id, an OpenAI job id (ftjob-...) or fine-tuned model (ft:...)")
    export.add_argument("dir", metavar="DIR")
    export.add_argument("--dequantize", action="store_true", help="write a quantized base's fused model unquantized")
    export.add_argument("--gguf", action="store_true", help="also write ggml-model-f16.gguf (llama, mixtral and "
                        "mistral models, unquantized or with --dequantize)")
    export.add_argument("--quantize", action="store_true", help="quantize the fused model: to the job's QAT bits, "
                        "or to --quant-bits / --quant-mode")
    export.add_argument("--quant-bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="with --quantize: the bits")
    export.add_argument("--quant-mode", choices=["affine", "mxfp4", "mxfp8"], help="with --quantize: the mode")

    plot = add("plot", cmd_plot, "draw the job's curves (its kind's: reward, loss, KL, margins, ...) into a PNG")
    plot.add_argument("job_id", metavar="ID")
    plot.add_argument("--out", metavar="FILE.png", help="default: ID.png")
