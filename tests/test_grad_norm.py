"""The gradient's norm and its clipping (worker/runtime/train_core.py clipped): mlx's
clip_grad_norm's figures, with compiled kernels that do not depend on how many arrays the job
trains (a job of another layer count on a warm worker compiles none for it)."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from conftest import ROOT
from mlx.utils import tree_flatten

from worker.runtime.train_core import clipped

COUNT_KERNELS = """
import glob, json, sys, tempfile
import mlx.core as mx
from worker.runtime.train_core import clipped

def kernels():
    return set(glob.glob(tempfile.gettempdir() + "/mlx/*/cpu/*.so"))

new = []
for n in (28, 14, 56, 30):
    before = kernels()
    grads = {f"w{i}": mx.random.normal((4, 8)) for i in range(n)}
    mx.eval(mx.compile(lambda g: clipped(g, 1.0))(grads))
    new.append(len(kernels() - before))
print(json.dumps(new))
"""


def grads(n: int, dtype) -> dict:
    return {f"w{i}": (mx.random.normal((3, 5), key=mx.random.key(i)) * (i + 1)).astype(dtype) for i in range(n)}


@pytest.mark.parametrize("max_norm", [None, 1.0, 1e6])
def test_norm_and_clipped_gradients_are_clip_grad_norms(max_norm):
    g = grads(12, mx.float32)
    ours, norm = clipped(g, max_norm)
    theirs, their_norm = optim.clip_grad_norm(g, max_norm if max_norm is not None else float("inf"))
    np.testing.assert_allclose(norm.item(), their_norm.item(), rtol=1e-6)
    for (_, a), (_, b) in zip(tree_flatten(ours), tree_flatten(theirs)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
    if max_norm == 1.0:  # clipped: the result's norm is the bound
        assert abs(float(np.sqrt(sum((np.array(a) ** 2).sum() for _, a in tree_flatten(ours)))) - 1.0) < 1e-5


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="counts the CPU backend's compiled kernels")
def test_its_compiled_kernels_do_not_depend_on_the_count_of_trained_arrays(tmp_path):
    out = subprocess.run([sys.executable, "-c", COUNT_KERNELS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    first, *others = [int(n) for n in out.stdout.strip().strip("[]").split(",")]
    assert first > 0 and others == [0, 0, 0], (first, others)
