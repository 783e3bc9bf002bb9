"""A worker on another machine, as far as the network goes: it runs in its own network namespace
and reaches Redis only over a veth pair (no loopback shared with the API, no shared models
directory or MTQ_HOME). It completes a job, and the adapter downloads through the API.

Needs root (CI runs as root) and iproute2's `ip`; skipped, with the reason, otherwise."""

import io
import os
import shutil
import subprocess
import tarfile

import pytest

from conftest import Stack, running

JOBS = "/admin/api/fine-tune/grpo/jobs"
TAG = os.getpid() % 100_000
NS, HOST_IF, NS_IF = f"mtq-ns-{TAG}", f"mtqh{TAG}", f"mtqn{TAG}"
SUBNET = f"10.231.{TAG % 250}"
HOST_IP, NS_IP = f"{SUBNET}.1", f"{SUBNET}.2"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a network namespace (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create a network namespace"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def namespace():
    try:
        ip("netns", "add", NS)
    except subprocess.CalledProcessError as e:  # e.g. a container without CAP_SYS_ADMIN / CAP_NET_ADMIN
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        ip("link", "set", NS_IF, "netns", NS)
        ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        ip("link", "set", HOST_IF, "up")
        ip("netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        ip("netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, namespace):
    yield from running(Stack(tmp_path_factory.mktemp("netns"), tiny_model, redis_bind=f"127.0.0.1 {HOST_IP}"))


def test_a_worker_in_another_network_namespace_runs_a_job_and_its_adapter_downloads(stack, namespace):
    home = stack.workdir / "remote"
    shutil.copytree(stack.tiny_model, home / "models" / "remote-tiny")
    env = dict(stack.env, REDIS_URL=f"redis://{HOST_IP}:{stack.redis_server.port}/0", MTQ_HOME=str(home),
               MTQ_MODELS_DIR=str(home / "models"), MTQ_MODEL_ROOTS="", HF_HOME=str(home / "hf"))
    # Loopback inside the namespace is its own: the host's Redis is not there.
    probe = subprocess.run(["ip", "netns", "exec", namespace, "redis-cli", "-p", str(stack.redis_server.port), "ping"],
                           capture_output=True, text=True, timeout=30)
    assert "PONG" not in probe.stdout
    stack.start_worker("--name", "remote", env=env, prefix=("ip", "netns", "exec", namespace))

    job_id = stack.submit({"model_id": "remote-tiny", "prompts": ["What is 2+2?", "Say hello."],
                           "config": {"group_size": 2, "batch_size": 2, "iters": 2, "max_completion_len": 8,
                                      "lora_layers": 2}})
    job = stack.wait_job(job_id, timeout=180)
    assert job["status"] == "completed" and job["worker"] == "remote", job["error"]
    with stack.client() as c:
        res = c.get(f"{JOBS}/{job_id}/adapter")
    assert res.status_code == 200, res.text
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        assert {"adapters.safetensors", "adapter_config.json"} <= {m.name.split("/")[-1] for m in tar.getmembers()}
