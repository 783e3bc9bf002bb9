"""MLX's settings in the training process (worker/supervisor/mlx_env.py): its CUDA graph cache
misses are not counted toward MLX's "Cache thrashing" error, which would otherwise fail every job
of a long-lived worker once it had seen enough graphs."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import ROOT

# Distinct CUDA graphs, one per evaluation (the cache key is the graph's topology: the chain's length).
MANY_GRAPHS = """
import mlx.core as mx
x = mx.ones((64,))
for n in range(1, 41):
    y = x
    for _ in range(n):
        y = mx.exp(y * 0.5)
    mx.eval(y)
print("done")
"""
PRINT_SETTING = "import os; print(os.environ.get('MLX_ENABLE_CACHE_THRASHING_CHECK'))"


def run(tmp_path, code: str, through_child_main: bool, **env) -> subprocess.CompletedProcess:
    """`code` in a new interpreter: run as the training process's entry runs its main, or plainly."""
    script = tmp_path / "main.py"
    script.write_text(code)
    launcher = ("from worker.supervisor.child import child_main; child_main('runpy.run_path', %r)" % str(script)
                if through_child_main else "import runpy; runpy.run_path(%r)" % str(script))
    inherited = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
    env = {**inherited, "PYTHONPATH": str(ROOT), "MTQ_HOME": str(tmp_path / "home"), **env}
    return subprocess.run([sys.executable, "-c", launcher], env=env, capture_output=True, text=True, timeout=300)


def test_the_training_process_turns_the_miss_count_off_unless_the_environment_names_it(tmp_path):
    assert run(tmp_path, PRINT_SETTING, True).stdout.strip() == "0"
    assert run(tmp_path, PRINT_SETTING, False).stdout.strip() == "None"
    assert run(tmp_path, PRINT_SETTING, True, MLX_ENABLE_CACHE_THRASHING_CHECK="1").stdout.strip() == "1"


@pytest.mark.skipif(not mx.cuda.is_available(), reason="MLX's CUDA backend")
def test_on_cuda_the_training_process_outlives_more_graph_misses_than_mlx_counts(tmp_path):
    # A cache of 4 graphs: MLX's count raises at the 9th miss; the chains make 40.
    plain = run(tmp_path, MANY_GRAPHS, False, MLX_CUDA_GRAPH_CACHE_SIZE="4")
    assert plain.returncode != 0 and "Cache thrashing" in plain.stderr, plain.stderr[-2000:]
    worker = run(tmp_path, MANY_GRAPHS, True, MLX_CUDA_GRAPH_CACHE_SIZE="4")
    assert worker.returncode == 0 and worker.stdout.strip() == "done", worker.stderr[-2000:]
