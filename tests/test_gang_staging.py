"""Gangs on unequal workers (docs/distributed.md): a member without the model receives it from
its leader over Redis, a slower member gets fewer rows, and the backends other than ring are
configured as MLX reads them and refused where this machine lacks them. Real workers over
loopback on the CPU (ring)."""

import hashlib
import json
import os

import pytest
from conftest import Stack, running, wait_done, wait_for
from test_distributed import (ADAPTER_TOLERANCE, LOSS_TOLERANCE, ROWS, SFT, SFT_CONFIG, adapter, adapter_diff,
                              advertisement, rel_diff, step_losses, submit)

SLOW_S_PER_ROW = 0.4  # the second worker's sleep per row of its local work (gang_group's hook)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("gang-stage"), tiny_model)
    s.env.update(MTQ_LEASE_TTL="2", MTQ_GANG_JOIN_S="60")
    yield from running(s)


def solo_then_gang(stack, client, name: str) -> tuple[str, str, dict]:
    """The same SFT job on one worker (adapter NAME-solo), then on a gang of two (NAME-gang):
    (the solo job's id, the gang job's id, the gang job's record once done)."""
    body = {"model_id": "tiny", "dataset": ROWS}
    solo = submit(client, SFT, {**body, "adapter_name": f"{name}-solo", "config": SFT_CONFIG})
    wait_done(stack, SFT, solo)
    gang = submit(client, SFT, {**body, "adapter_name": f"{name}-gang", "config": {**SFT_CONFIG, "workers": 2}})
    return solo, gang, wait_done(stack, SFT, gang)


def digests(directory) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_gang_counts_workers_that_can_receive_the_model_with_the_disk_for_it():
    from shared import routing
    from shared.train_specs import SFTJobCreate
    from worker.supervisor import gang_claims

    spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config={**SFT_CONFIG, "workers": 3})
    holder = {"model_id": "tiny", "size_bytes": 10**9}
    live = [advertisement("z-has", models=[holder]), advertisement("a-has", models=[holder]),
            advertisement("b-room", models=[], models_free_bytes=2 * 10**9),
            advertisement("c-full", models=[], models_free_bytes=10**8)]
    where = routing.route("sft", spec, live)
    assert [w["name"] for w in where.free] == ["a-has", "z-has", "b-room"] and where.waiting_for_worker is None
    assert where.queue.startswith("default@tiny@")  # only a worker with the model leads it
    assert [w["name"] for w in gang_claims.pick("z-has", list(where.free), 3)] == ["z-has", "a-has", "b-room"]
    four = routing.route("sft", SFTJobCreate(model_id="tiny", dataset=ROWS, config={**SFT_CONFIG, "workers": 4}), live)
    assert "has 3 (a-has, z-has, b-room) of 3 live" in four.waiting_for_worker  # c-full lacks the disk
    by_path = SFTJobCreate(model_id="/models/tiny", dataset=ROWS, config={**SFT_CONFIG, "workers": 2})
    path_live = [advertisement("a", models=[{**holder, "model_id": "/models/tiny"}]),
                 advertisement("b", models=[], models_free_bytes=10**12)]
    assert [w["name"] for w in routing.route("sft", by_path, path_live).free] == ["a"]  # another machine's path


def test_a_corrupted_chunk_is_refused_and_nothing_is_written(stack, tmp_path):
    from worker.runtime import model_staging as staging

    manifest = staging.publish(stack.redis, stack.tiny_model)
    weights = next(f for f in manifest["files"] if f["path"].endswith(".safetensors"))
    assert weights["size"] > 0 and all(stack.redis.exists(staging.chunk_key(h)) for h in weights["chunks"])
    good = staging.fetch(stack.redis, manifest, tmp_path / "models" / "tiny")
    assert digests(good) == digests(stack.tiny_model)
    bad = weights["chunks"][0]
    stack.redis.set(staging.chunk_key(bad), b"not the chunk")
    with pytest.raises(staging.StagingFailed, match="does not match its hash"):
        staging.fetch(stack.redis, manifest, tmp_path / "models" / "again")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]  # no partial model, no staging dir
    assert not stack.redis.exists(staging.chunk_key(bad))  # dropped: the next attempt stores it again
    staging.publish(stack.redis, stack.tiny_model)
    assert digests(staging.fetch(stack.redis, manifest, tmp_path / "models" / "again")) == digests(stack.tiny_model)
    hostile = {"files": [{"path": "../outside", "size": 0, "chunks": []}]}
    with pytest.raises(staging.StagingFailed, match="outside the model directory"):
        staging.fetch(stack.redis, hostile, tmp_path / "models" / "hostile")
    assert not (tmp_path / "outside").exists()


def test_a_slow_member_with_no_model_receives_it_takes_fewer_rows_and_the_gang_trains_as_one_worker(
        stack, client, tmp_path_factory):
    """stage-b has an empty models directory and sleeps SLOW_S_PER_ROW per row: the leader
    (stage-a, the only worker with the model) stages the model to it, and from the second step
    on gives it fewer rows; the losses and adapter are the one worker's."""
    empty = tmp_path_factory.mktemp("empty-models")
    a = stack.start_worker("--name", "stage-a")
    b = stack.start_worker("--name", "stage-b", env={**stack.env, "MTQ_MODELS_DIR": str(empty),
                                                     "MTQ_GANG_SLOW_S_PER_ROW": str(SLOW_S_PER_ROW)})
    try:
        solo, gang, job = solo_then_gang(stack, client, "stage")
        assert job["worker"] == "stage-a" and job["failed_attempts"] == 0
        assert json.loads(stack.redis.hget(f"mtq:job:{gang}", "gang")) == ["stage-a", "stage-b"]
        staged = [e for _, e in stack.events(gang) if e["type"] == "model_staged"]
        assert [(e["model_id"], e["ranks"]) for e in staged] == [("tiny", [1])]
        assert digests(empty / "tiny") == digests(stack.tiny_model)
        steps = [e for _, e in stack.events(gang) if e["type"] == "sft_step"]
        rows = [(e["gang/rows_rank0"], e["gang/rows_rank1"]) for e in steps]
        a_loss, b_loss = step_losses(stack, gang, "sft"), step_losses(stack, solo, "sft")
        loss_diff, weight_diff = rel_diff(a_loss, b_loss), adapter_diff(adapter(client, "stage-gang"),
                                                                        adapter(client, "stage-solo"))
        print(f"\nstaged gang with a slow member: rows per rank {rows}; differences from one worker: losses "
              f"{loss_diff:.2e}, adapter {weight_diff:.2e}")
        assert rows[0] == (2, 2) and all(r0 > r1 >= 1 and r0 + r1 == 4 for r0, r1 in rows[1:]), rows
        assert loss_diff < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE
    finally:
        for p in (a, b):
            stack.stop_proc(p)


def test_each_backend_is_configured_as_mlx_reads_it_and_refused_where_missing(stack, client, tmp_path):
    from worker.runtime import gang_group
    from worker.supervisor import gang_claims

    hosts = [["10.0.0.1:5701"], ["10.0.0.2:5702"]]
    ring = gang_group.backend_env("ring", 1, hosts, tmp_path)
    assert ring["MLX_RANK"] == "1" and json.loads(open(ring["MLX_HOSTFILE"]).read()) == hosts
    assert gang_group.backend_env("nccl", 1, hosts, tmp_path) == {
        "MLX_RANK": "1", "MLX_WORLD_SIZE": "2", "NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "5701"}
    cabled = [advertisement(n, gang_backend="jaccl", gang_address=f"10.0.0.{i}:5701",
                            gang_rdma={p: f"rdma_en{j}" for j, p in enumerate("abc") if p != n})
              for i, n in enumerate("abc")]
    members = gang_claims.pick("a", cabled, 3)
    entries = gang_claims.hostfile(members)
    assert entries[1] == ["10.0.0.1:5701", "rdma_en0", "", "rdma_en2"]
    jaccl = gang_group.backend_env("jaccl", 2, entries, tmp_path)
    assert jaccl["MLX_JACCL_COORDINATOR"] == "10.0.0.0:5701" and "MLX_JACCL_RING" not in jaccl
    assert json.loads(open(jaccl["MLX_IBV_DEVICES"]).read()) == [
        [None, "rdma_en1", "rdma_en2"], ["rdma_en0", None, "rdma_en2"], ["rdma_en0", "rdma_en1", None]]
    assert gang_group.backend_env("jaccl-ring", 0, entries, tmp_path)["MLX_JACCL_RING"] == "1"
    uncabled = [*cabled[:2], {**cabled[2], "gang_rdma": {"a": "rdma_en0"}}]  # c has no device to b
    assert gang_claims.pick("a", uncabled, 3) is None
    assert gang_claims.pick("a", [{**w, "gang_backend": "jaccl-ring"} for w in uncabled], 3) is None
    assert gang_claims.pick("a", [cabled[0], {**cabled[1], "gang_backend": "ring"}], 2) is None  # one backend a gang
    # Where MLX lacks the backend (this CPU build: no nccl, no jaccl), joining is refused at
    # once, and a worker set to it offers no gang address, saying why.
    for backend in ("nccl", "jaccl", "jaccl-ring"):
        if gang_group.backend_error(backend):
            with pytest.raises(RuntimeError, match=f"MTQ_GANG_BACKEND={backend}: .* has no"):
                gang_group.join(0, hosts, backend)
    with pytest.raises(RuntimeError, match="not one of"):
        gang_group.join(0, hosts, "tcp")
    if not gang_group.backend_error("nccl"):
        pytest.skip("this machine has MLX's nccl backend")
    worker = stack.start_worker("--name", "stage-nccl", env={**stack.env, "MTQ_GANG_BACKEND": "nccl"})
    try:
        ad = wait_for(lambda: (w := client.get("/admin/api/workers/stage-nccl").json()).get("gang_backend") and w, 60,
                      "the worker's advertisement with its backend")
        assert ad["gang_backend"] == "nccl" and ad["gang_address"] is None and "no nccl backend" in ad["gang_error"]
    finally:
        stack.stop_proc(worker)


def test_an_nccl_gang_trains_as_one_worker(stack, client):
    """Where MLX has nccl (its CUDA build): two workers, one GPU each (MTQ_TEST_GPUS, e.g. "0,1";
    NCCL refuses two ranks on one GPU), gang over nccl and train as one worker."""
    from worker.runtime import gang_group

    if gang_group.backend_error("nccl") or not os.environ.get("MTQ_TEST_GPUS"):
        pytest.skip("needs MLX's nccl backend and MTQ_TEST_GPUS (one GPU per worker)")
    gpus = os.environ["MTQ_TEST_GPUS"].split(",")
    procs = [stack.start_worker("--name", f"nccl-{i}", env={**stack.env, "MTQ_GANG_BACKEND": "nccl",
                                                            "CUDA_VISIBLE_DEVICES": gpu}) for i, gpu in enumerate(gpus[:2])]
    try:
        solo, gang, job = solo_then_gang(stack, client, "nccl")
        loss_diff = rel_diff(step_losses(stack, gang, "sft"), step_losses(stack, solo, "sft"))
        weight_diff = adapter_diff(adapter(client, "nccl-gang"), adapter(client, "nccl-solo"))
        print(f"\nnccl gang of 2 vs 1 worker: losses {loss_diff:.2e}, adapter {weight_diff:.2e}")
        assert job["failed_attempts"] == 0 and loss_diff < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE
    finally:
        for p in procs:
            stack.stop_proc(p)


def test_speed_shares_stay_within_what_routing_sized_each_member_for():
    """A much faster member takes more rows, but never more than routing.max_share of a step
    (what its memory was sized for); the rest go to the others; equal speeds split evenly."""
    from shared.routing import max_share
    from worker.runtime.gang_group import apportion

    assert apportion(8, [1.0, 1.0]) == [4, 4] and apportion(8, [2.0, 1.0]) == [5, 3]
    for n, speeds in ((8, [10.0, 1.0]), (8, [1.0, 10.0]), (9, [1.0, 1.0, 10.0]), (16, [5.0, 1.0, 1.0, 1.0])):
        counts = apportion(n, speeds)
        assert sum(counts) == n and max(counts) == max_share(n, len(speeds)) and min(counts) >= 1, (n, speeds, counts)
