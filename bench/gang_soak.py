"""A soak of a gang of two on loopback: one SFT job of --steps steps (1,000 by default) on two
workers of a private stack (bench/private_stack.py: `mtq up --workers 2`), on a tiny model and a
batch of two rows, as cheap a step as a gang makes.

    python bench/gang_soak.py [--steps 1000] [--stall-timeout 30]

A collective that hangs (ml-explore/mlx#4475 reports ring all_sum hanging in a few percent of
calls in such loops) stalls the step: the watchdog ends the attempt after stall_timeout_s and a
new gang resumes from the last checkpoint (docs/distributed.md). Printed: the wall time and
steps per second, the attempts the job spent (failed_attempts), each re-queue's reason and the
time from it to the new gang's resumed step (the recovery), and whether every step is in the
history once.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.private_stack import free_port, private_stack, wait_for_workers  # noqa: E402
from shared.events import decode_events  # noqa: E402
from shared.keys import events_key  # noqa: E402
from worker.runtime.make_model import make_model  # noqa: E402

SFT = "/admin/api/fine-tune/jobs"
ROWS = [{"prompt": f"Q{i}?", "completion": f"answer {i}"} for i in range(8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--stall-timeout", type=float, default=30.0, help="the job's stall_timeout_s")
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp(prefix="mtq-soak-")) / "tiny"
    make_model(model, size="tiny", seed=0)
    redis_port = free_port()
    config = {"workers": 2, "iters": args.steps, "batch_size": 2, "lora_layers": 1, "lora_rank": 2,
              "max_seq_length": 32, "steps_per_report": 10, "steps_per_save": 100,
              "stall_timeout_s": args.stall_timeout, "max_attempts": 100, "seed": 1}
    with private_stack(model, workers=2, MTQ_REDIS_PORT=str(redis_port)) as (stack, client, log):
        wait_for_workers(client, stack, log, count=2)
        r = redis.Redis(port=redis_port)
        res = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "adapter_name": "soak", "config": config})
        res.raise_for_status()
        job_id = res.json()["job_id"]
        t0 = time.monotonic()
        while (job := client.get(f"{SFT}/{job_id}").json())["status"] not in ("completed", "failed", "cancelled"):
            assert stack.poll() is None, log.read_text()[-3000:]
            time.sleep(2)
        wall = time.monotonic() - t0
        events = decode_events([(events_key(job_id), r.xrange(events_key(job_id)))])
        history = client.get(f"{SFT}/{job_id}/history").json()["history"]
    at = [(int(i.split("-")[0]) / 1000, e) for i, e in events]
    requeues = [(t, e) for t, e in at if e["type"] == "requeued"]
    print(f"job {job_id}: {job['status']}, {args.steps} steps on a gang of 2 in {wall:.1f} s "
          f"({args.steps / wall:.1f} steps/s); attempts lost: {job['failed_attempts']}; "
          f"re-queued {len(requeues)} times; every step in the history once: "
          f"{[h['step'] for h in history] == list(range(1, args.steps + 1))}")
    for t, e in requeues:
        resumed = next(((u, f) for u, f in at if u >= t and f["type"] == "resumed"), None)
        after = "never resumed" if resumed is None else (f"resumed from step {resumed[1]['from_step']} "
                                                         f"{resumed[0] - t:.1f} s later")
        print(f"  re-queued (counted: {e['counted']}): {e['reason']}; {after}")


if __name__ == "__main__":
    main()
