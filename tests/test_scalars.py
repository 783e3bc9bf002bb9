"""worker/runtime/scalars.py: a job's numbers are inputs of the functions it compiles, so a job
that differs from an earlier one only in its numbers compiles no kernel of its own.

A real training process's setup (tests/compiled_numbers.py, its own kernel cache) runs a step of
each kind's job and then of one that changes every number: the LoRA scale (lora_alpha), the
learning rate and gradient clip, and the kind's own (GRPO's temperature, top_p, min_p, clip range
and beta; DPO's, ORPO's, KTO's and CPO's betas, weights and label smoothing). Before this, the
second job of each kind compiled 1 to 14 kernels of its own (GRPO 14): seconds each on CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("compiled_numbers.py")


def test_a_job_that_changes_only_numbers_compiles_no_kernel(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, str(CHILD), str(tiny_model), str(tmp_path / "kernel-cache")],
                         capture_output=True, text=True, timeout=900,
                         env={k: v for k, v in os.environ.items() if k != "CUDA_CACHE_PATH"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [line["kind"] for line in lines] == ["grpo", "sft", "dpo", "orpo", "kto", "cpo"]
    assert lines[0]["first"] > 0  # the cache is the process's own: its first job compiled into it
    assert {line["kind"]: line["new"] for line in lines} == {line["kind"]: [] for line in lines}
