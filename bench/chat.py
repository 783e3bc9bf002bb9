"""Chat completions through the service: concurrent requests decoded together against the same
requests one at a time, and against mlx_lm's own decode of one request in this process.

    python bench/chat.py MODEL_DIR [--clients 8] [--tokens 64] [--rounds 5]

Starts a private stack (`mtq up`: redis-server, the API, one worker) with MODEL_DIR as its
model. A request is POST /v1/completions of --tokens tokens at temperature 0 (a prompt of a
few words, each client its own). Each round runs, in an order reversed every other round:
  together    --clients requests at once (threads): the worker decodes them as one batch
              (worker/runtime/completions.py), as many as are queued when a turn starts
  one by one  the same requests, each sent when the last was answered
  mlx_lm      mlx_lm.generate of one such request in this process (no service; a single row)
Printed: each case's generated tokens per second over the rounds (min / median / max), and the
ratio together / one by one of the medians with the rounds' own smallest and largest (the
spread). One warm-up round is not counted (compilation). On Linux CPU the process first
re-executes itself with the system OpenBLAS, as a worker does (worker/supervisor/openblas.py).
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

from mlx_lm import generate, load  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from bench.private_stack import private_stack, wait_for_workers  # noqa: E402

WORDS = "red blue green stone river cloud apple tree house car road sun moon star bird fish".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)) for i in range(n)]


def ask(client, model: str, prompt: str, tokens: int) -> int:
    resp = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": tokens,
                                                "temperature": 0})
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"]


def together(client, model: str, texts: list[str], tokens: int) -> float:
    counts = [0] * len(texts)

    def one(i):
        counts[i] = ask(client, model, texts[i], tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def one_by_one(client, model: str, texts: list[str], tokens: int) -> float:
    t0 = time.perf_counter()
    n = sum(ask(client, model, text, tokens) for text in texts)
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model_dir = args.model_dir.resolve()
    texts = prompts(args.clients)
    model, tokenizer = load(str(model_dir))

    def local() -> float:
        t0 = time.perf_counter()
        out = generate(model, tokenizer, prompt=texts[0], max_tokens=args.tokens, sampler=make_sampler(0.0))
        return len(tokenizer.encode(out, add_special_tokens=False)) / (time.perf_counter() - t0)

    with private_stack(model_dir) as (stack, client, log):
        wait_for_workers(client, stack, log)
        cases = {"together": lambda: together(client, model_dir.name, texts, args.tokens),
                 "one by one": lambda: one_by_one(client, model_dir.name, texts, args.tokens), "mlx_lm": local}
        for run in cases.values():  # warm-up: compilation, the model loaded
            run()
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
                rates[name].append(cases[name]())
    print(f"{args.clients} clients x {args.tokens} tokens, {args.rounds} rounds ({model_dir.name})")
    for name, rate in rates.items():
        print(f"{name:10s} tokens/s  min {min(rate):.1f}  median {statistics.median(rate):.1f}  max {max(rate):.1f}")
    ratios = [a / b for a, b in zip(rates["together"], rates["one by one"])]
    print(f"together / one by one  {statistics.median(rates['together']) / statistics.median(rates['one by one']):.2f}x"
          f"  (rounds: {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
