"""`mtq`: the command line. Only argument parsing lives here; each command imports what
it needs when it runs, so that `mtq api` never loads the worker (or mlx). The client
commands (submit, jobs, watch...) are in cli/commands.py."""

import argparse
import os
import re
import sys
from pathlib import Path

from shared.routing import WORKER_NAME
from shared.schemas import DEFAULT_LANE, LANE_PATTERN
from shared.settings import load_settings


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    # timeout_graceful_shutdown: open SSE streams would otherwise keep the server from
    # stopping on SIGTERM until every job they follow has finished.
    uvicorn.run("api.main:app", host=args.host, port=args.port, timeout_graceful_shutdown=5)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    if args.print_service:
        from cli.service import print_service

        return print_service(args.print_service, worker_args(args))
    from worker.supervisor.supervisor import run_worker

    run_worker(args.lanes, args.name, models=args.models, memory_gb=args.memory_gb, hub=args.hub)
    return 0


def worker_args(args: argparse.Namespace) -> list[str]:
    """The worker's options as given, for a service definition that runs the same worker."""
    argv = ["--lanes", ",".join(args.lanes)] + (["--name", args.name] if args.name else [])
    argv += ["--models", *args.models] if args.models else []
    argv += ["--memory-gb", repr(args.memory_gb)] if args.memory_gb else []
    return argv + (["--hub"] if args.hub else [])


def _lanes(text: str) -> list[str]:
    lanes = [lane.strip() for lane in text.split(",") if lane.strip()]
    if not lanes or not all(re.fullmatch(LANE_PATTERN, lane) for lane in lanes) or len(lanes) > 16:
        raise argparse.ArgumentTypeError("1 to 16 comma-separated lane names (a-z, 0-9, _ and -)")
    return lanes


def _name(text: str) -> str:
    if not WORKER_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError("letters, digits, '.', '_' and '-' (at most 64)")
    return text


def _gb(text: str) -> float:
    gb = float(text)
    if not 0 < gb <= 1e6:
        raise argparse.ArgumentTypeError("a number of GB above 0")
    return gb


def cmd_make_model(args: argparse.Namespace) -> int:
    from worker.runtime.make_model import make_model

    path = make_model(args.dir, size=args.size, quantize=args.quantize, seed=args.seed, quantize_mode=args.quantize_mode)
    print(path or args.dir)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from cli.stack import run_stack

    return run_stack(port=args.port, workers=args.workers, dashboard_port=args.dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from cli.dashboard import run_dashboard

    return run_dashboard(args.host, args.port)


def cmd_mcp(args: argparse.Namespace) -> int:
    from cli.mcp_server import serve

    return serve(args.http, args.host, args.port, Path(args.files_dir or load_settings().home / "mcp").expanduser())


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return n


def build_parser() -> argparse.ArgumentParser:
    settings = load_settings()
    parser = argparse.ArgumentParser(
        prog="mtq", description="Fine-tuning of MLX language models (GRPO, SFT, DPO, ORPO, KTO, reward models) as queued jobs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    api = commands.add_parser("api", help="serve the REST API (uvicorn)")
    api.add_argument("--host", default=settings.api_host, help="default: MTQ_API_HOST (%(default)s)")
    api.add_argument("--port", type=int, default=settings.api_port, help="default: MTQ_API_PORT (%(default)s)")
    api.set_defaults(func=cmd_api)

    worker = commands.add_parser("worker", help="run a training worker (rq) on REDIS_URL")
    worker.add_argument("--lanes", type=_lanes, default=[DEFAULT_LANE], metavar="LANE,...",
                        help="job lanes (a job's config.queue) to serve, first first (default: %(default)s)")
    worker.add_argument("--name", type=_name, help="worker name (default: <host>-<pid>)")
    worker.add_argument("--models", nargs="+", default=[], metavar="MODEL_ID",
                        help="model ids to take jobs for besides those in MTQ_MODELS_DIR, MTQ_MODEL_ROOTS and the "
                             "Hugging Face cache (e.g. Hugging Face ids this worker downloads); on an empty "
                             "kernel cache the worker warms them up (compiles MLX's kernels) before its first job")
    worker.add_argument("--memory-gb", type=_gb, help="memory jobs may use here (default: detected: Metal's "
                        "recommended working set, else 90%% of a GPU's memory, else 75%% of RAM)")
    worker.add_argument("--hub", action="store_true",
                        help="this worker reaches the Hugging Face hub: it takes jobs for Hugging Face ids no live worker holds")
    worker.add_argument("--print-service", choices=["launchd", "systemd"],
                        help="print a launchd plist or systemd unit that runs this worker as a service, and exit")
    worker.set_defaults(func=cmd_worker)

    make = commands.add_parser("make-model", help="write a random-weight model directory (for tests and benchmarks)")
    make.add_argument("dir", metavar="DIR")
    make.add_argument("--size", choices=["tiny", "small", "qwen3-0.6b"], default="tiny")
    make.add_argument("--quantize", type=int, metavar="BITS", help="quantize the weights to BITS bits (2, 3, 4, 5, 6, 8)")
    make.add_argument("--quantize-mode", choices=["affine", "mxfp4", "mxfp8"], default="affine",
                      help="MLX's quantization mode (mxfp4: --quantize 4, mxfp8: --quantize 8)")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=cmd_make_model)

    up = commands.add_parser("up", help="run the local stack in the foreground: redis (if REDIS_URL is unset), API, workers")
    up.add_argument("--port", type=int, default=settings.api_port, help="API port (default: MTQ_API_PORT, %(default)s)")
    up.add_argument("--workers", type=_count, default=1, help="number of workers (default: %(default)s)")
    up.add_argument("--dashboard", type=int, nargs="?", const=9181, metavar="PORT",
                    help="also serve rq-dashboard on 127.0.0.1:PORT (default port 9181)")
    up.set_defaults(func=cmd_up)

    dash = commands.add_parser("dashboard", help="serve rq-dashboard on REDIS_URL (loopback unless told otherwise)")
    dash.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s; others need MTQ_API_TOKEN)")
    dash.add_argument("--port", type=int, default=9181, help="default: %(default)s")
    dash.set_defaults(func=cmd_dashboard)

    mcp = commands.add_parser("mcp", help="an MCP server over the REST API (stdio; --http: streamable HTTP)")
    mcp.add_argument("--http", action="store_true", help="serve streamable HTTP on HOST:PORT/mcp instead of stdio; "
                     "each request brings its own token (Authorization: Bearer)")
    mcp.add_argument("--host", default="127.0.0.1", help="with --http (default: %(default)s)")
    mcp.add_argument("--port", type=int, default=8765, help="with --http (default: %(default)s)")
    mcp.add_argument("--files-dir", metavar="DIR", help="with --http: where the tools' local paths (a dataset file, "
                     "an adapter's directory) must lie (default: $MTQ_HOME/mcp)")
    mcp.set_defaults(func=cmd_mcp)

    from cli.commands import add_client_commands

    add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `mtq logs ID | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
