"""A new worker starts warm (worker/supervisor/kernel_share.py): workers of one fleet (MLX version,
device) share their compiled kernels through Redis, each entry verified before it is written into
a worker's kernel cache; and the training process keeps the CUDA driver's cache beside MLX's.

Worker `a` runs a job on the tests' shared kernel cache (warm) and publishes its kernels; worker
`b`, with an empty cache, fetches them before its first job, which then compiles nothing. The
kernels `b`'s job loaded (their access times) are then corrupted or replaced by entries compiled
for another MLX version or device, and an entry named as a path out of the cache is added:
worker `c`, with an empty cache, refuses them all, compiles the three kernels again during its
job, and publishes its own.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import ROOT, wait_for
from shared.keys import KERNELS_BYTES, kernel_entry_key
from worker.supervisor import kernel_cache
from worker.supervisor.kernel_share import ENTRY_MAX_BYTES, KernelShare, fleet_id, pack, unpack

CONFIG = {"iters": 2, "group_size": 2, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2, "lora_rank": 4,
          "lora_alpha": 8.0}


def cache_files(cache: Path) -> list[Path]:
    """kernel_cache.compiled_kernels of a training process whose kernel cache is `cache`."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(cache)
    try:
        return kernel_cache.compiled_kernels(mx.__version__, "cpu")
    finally:
        tempfile.tempdir = saved


def index_key(r) -> bytes:
    keys = r.keys("mtq:kernels:index:*")
    assert len(keys) == 1, keys  # one fleet: this machine's CPU
    return keys[0]


def run_job(stack, worker_env: dict, cache: Path, name: str) -> dict:
    """Start worker `name` on `cache`, run one GRPO job on it, wait until it has published its
    cache's kernels, stop it; what it saw."""
    worker = stack.start_worker("--name", name, env=dict(worker_env, MTQ_KERNEL_CACHE=str(cache)))
    try:
        before = cache_files(cache)  # the worker registers with rq once its training process is ready: fetched
        for p in before:  # access times older than the files: those the job loads are then newer
            os.utime(p, (p.stat().st_mtime - 1000, p.stat().st_mtime))
        job_id = stack.submit({"model_id": stack.tiny_model.name, "prompts": ["Say hello."], "config": CONFIG})
        job = stack.wait_job(job_id, timeout=180)
        assert job["status"] == "completed", job
        after = cache_files(cache)
        loaded = {p.name for p in after if p.stat().st_atime > p.stat().st_mtime}
        r = stack.redis
        wait_for(lambda: {p.name for p in after} <= {n.decode() for n in r.hkeys(index_key(r))}, 30,
                 f"worker {name} to publish every kernel of its cache")
        return {"before": {p.name for p in before}, "after": {p.name for p in after}, "loaded": loaded}
    finally:
        stack.stop_proc(worker)


@pytest.fixture(scope="module")
def fleet(stack, tmp_path_factory):
    """Worker `a` (the shared warm cache) runs a job and publishes; then worker `b` (an empty cache)."""
    env = dict(stack.env, MTQ_KERNEL_SHARE_MB="128")
    shared = Path(os.environ["MTQ_KERNEL_CACHE"])
    run_job(stack, env, shared, "a")
    r = stack.redis
    published = {n.decode(): sha.decode() for n, sha in r.hgetall(index_key(r)).items()}
    b = run_job(stack, env, tmp_path_factory.mktemp("b"), "b")
    return {"env": env, "published": published, "b": b}


def test_a_worker_with_an_empty_cache_fetches_the_fleets_kernels_and_compiles_none(stack, fleet):
    b = fleet["b"]
    print(f"\nworker b fetched {len(b['before'])} kernels; its job loaded {len(b['loaded'])} of them "
          f"and compiled {len(b['after'] - b['before'])}")
    assert b["before"] == set(fleet["published"])  # every kernel the fleet had, before its first job
    assert b["loaded"], "the job loaded none of the fetched kernels"
    assert b["after"] == b["before"]  # its first step compiled nothing new
    r = stack.redis
    stored = sum(r.strlen(kernel_entry_key(sha)) for sha in fleet["published"].values())
    assert int(r.get(KERNELS_BYTES)) == stored  # what MTQ_KERNEL_SHARE_MB bounds
    print(f"the fleet's share: {len(fleet['published'])} kernels, {stored / 2**20:.1f} MB;",
          *re.findall(r"kernel share: (?:fetched|published) \d+ kernels .*? in [\d.]+ s", stack.logs("worker", tail=None)))


def test_a_corrupted_or_foreign_kernel_is_refused_and_compiled_again(stack, fleet, tmp_path):
    r = stack.redis
    index = index_key(r)
    names = sorted(fleet["b"]["loaded"])[:3]  # kernels the job needs
    assert len(names) == 3, names
    genuine = {name: r.get(kernel_entry_key(fleet["published"][name])) for name in names}
    ours = json.loads(genuine[names[0]].partition(b"\n")[0])["fleet"]

    corrupted = genuine[names[0]][:-1] + bytes([genuine[names[0]][-1] ^ 0xFF])  # under its old address
    r.set(kernel_entry_key(fleet["published"][names[0]]), corrupted)
    foreign = {names[1]: dict(ours, mlx="0.0.1"), names[2]: dict(ours, device="gpu", device_name="NVIDIA H200")}
    forged = []
    for name, other in foreign.items():
        files = unpack(genuine[name], fleet["published"][name], name, ours, "cpu")
        entry = pack(name, other, files)  # well formed, its sha256 right: only its fleet is another
        forged.append(kernel_entry_key(hashlib.sha256(entry).hexdigest()))
        r.set(forged[-1], entry)
        r.hset(index, name, forged[-1].rsplit(":", 1)[1])
    escape = "../../../../escaped.so"  # well formed for this fleet, but a path out of the cache
    entry = pack(escape, ours, [(escape, b"not a kernel")])
    forged.append(kernel_entry_key(hashlib.sha256(entry).hexdigest()))
    r.set(forged[-1], entry)
    r.hset(index, escape, forged[-1].rsplit(":", 1)[1])

    c = run_job(stack, fleet["env"], tmp_path / "c", "c")
    print(f"\nworker c fetched {len(c['before'])} kernels, refused 4; its job compiled {sorted(c['after'] - c['before'])}")
    assert c["before"] == set(fleet["published"]) - set(names)  # never written, so never loaded
    assert c["after"] == c["before"] | set(names)  # compiled again by the job
    logs = stack.logs("worker", tail=None)
    assert f"refused {names[0]}: its content does not match its sha256" in logs
    for name, other in foreign.items():
        assert f"refused {name}: it was compiled for another fleet ({fleet_id(other)})" in logs
    assert f"refused {escape}: its name is not a path inside the cache" in logs
    assert not list(tmp_path.rglob("escaped.so")) and not r.hexists(index, escape)
    for name in names:  # c published its own after its job (run_job waits for it): they verify for this fleet
        sha = r.hget(index, name).decode()
        assert isinstance(unpack(r.get(kernel_entry_key(sha)), sha, name, ours, "cpu"), list), name
    assert not any(r.exists(key) for key in forged)  # the refused entries left Redis
    assert r.get(kernel_entry_key(fleet["published"][names[0]])) != corrupted


def test_the_training_process_keeps_the_cuda_drivers_cache_beside_mlxs(tmp_path):
    """child_main, the training process's entry, sets what the CUDA driver reads before MLX loads:
    `env` run from it prints the environment the training process and its children have."""
    def environment_of_child(**env) -> dict:
        entry = "from worker.supervisor.child import child_main; child_main('subprocess.run', ['env'])"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_CACHE")}
        out = subprocess.run([sys.executable, "-c", entry], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=dict(clean, MTQ_KERNEL_CACHE=str(tmp_path / "kc"), PYTHONPATH=str(ROOT), **env))
        assert out.returncode == 0, out.stderr
        return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)

    env = environment_of_child()
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "kc" / "cuda-driver")
    assert int(env["CUDA_CACHE_MAXSIZE"]) == 4 * 2**30
    assert env["TMPDIR"] == str(tmp_path / "kc")  # MLX's own kernels
    assert environment_of_child(CUDA_CACHE_PATH="/elsewhere")["CUDA_CACHE_PATH"] == "/elsewhere"  # the operator's choice


def test_the_share_stays_within_its_caps(stack, tmp_path):
    """MTQ_KERNEL_SHARE_MB bounds all fleets' entries together, first come first kept; an entry
    over ENTRY_MAX_BYTES is never published; 0 publishes and fetches nothing."""
    r = stack.redis
    where = tmp_path / "cpu"
    where.mkdir()
    for i in range(4):
        (where / f"lib{i}.so").write_bytes(bytes([i]) * 100_000)
    (where / "libhuge.so").write_bytes(b"h" * (ENTRY_MAX_BYTES + 1))
    for p in where.iterdir():  # older than FRESH_S: not being written
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 60))
    fleet = {"mlx": "caps-test", "device": "cpu", "device_name": "test", "machine": "test"}
    total = int(r.get(KERNELS_BYTES) or 0)  # the other tests' entries count too
    assert KernelShare(r, where, "cpu", fleet, 0).publish() == 0
    assert KernelShare(r, where, "cpu", fleet, (total + 250_000) / 2**20).publish() == 2  # the third would pass the cap
    index = {n.decode() for n in r.hkeys(f"mtq:kernels:index:{fleet_id(fleet)}")}
    assert index == {"lib0.so", "lib1.so"}
    assert total + 200_000 < int(r.get(KERNELS_BYTES)) <= total + 250_000
    fresh = tmp_path / "fresh"
    KernelShare(r, fresh, "cpu", fleet, 0).fetch()
    assert not fresh.exists()
    KernelShare(r, fresh, "cpu", fleet, 1).fetch()
    assert sorted(p.name for p in fresh.iterdir()) == ["lib0.so", "lib1.so"]
    assert (fresh / "lib1.so").read_bytes() == bytes([1]) * 100_000
