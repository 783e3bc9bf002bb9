"""docker-compose.yml and the Dockerfile agree with the code (checked without Docker)."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from shared.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
MTQ_ENV = ("REDIS_URL", "MTQ_API_TOKEN", "MTQ_HOME", "MTQ_MODELS_DIR")


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def command(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd.split() if isinstance(cmd, str) else cmd


def test_services_exist(services):
    assert {"redis", "api", "worker"} <= services.keys()


def test_redis_is_durable(services):
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert " ".join(command(redis)).startswith("redis-server") and "--appendonly yes" in " ".join(command(redis))
    assert any(v.endswith(":/data") for v in redis["volumes"])


@pytest.mark.parametrize("name,subcommand", [("api", "api"), ("worker", "worker")])
def test_api_and_worker_run_mtq_with_the_settings(services, name, subcommand):
    service = services[name]
    assert command(service)[:2] == ["mtq", subcommand]
    env = service["environment"]
    assert set(MTQ_ENV) <= env.keys()
    assert env["REDIS_URL"] == "redis://redis:6379/0"
    assert env["MTQ_API_TOKEN"].startswith("${MTQ_API_TOKEN:-")  # from the host, with a default
    assert env["MTQ_HOME"] == "/data" and env["MTQ_MODELS_DIR"] == "/data/models"
    assert "mtq-data:/data" in service["volumes"]  # models and adapters shared by api and worker
    assert service.get("build") == "."


def test_api_is_published_on_all_interfaces(services):
    assert "--host" in command(services["api"]) and "0.0.0.0" in command(services["api"])
    assert any(str(p).endswith(":8000") for p in services["api"]["ports"])


def test_env_names_are_the_ones_the_settings_read(services, monkeypatch):
    for name, value in services["api"]["environment"].items():
        monkeypatch.setenv(name, re.sub(r"\$\{\w+:-(.*)\}", r"\1", value))  # compose's default
    settings = load_settings()
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.api_token == "change-me"
    assert str(settings.home) == "/data" and str(settings.models_dir) == "/data/models"


@pytest.mark.parametrize("subcommand", ["api", "worker"])
def test_the_compose_commands_exist_in_the_cli(services, subcommand):
    argv = command(services[subcommand])[1:] + ["--help"]
    res = subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: mtq {subcommand}")


def test_dockerfile_copies_existing_files_and_installs_the_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.12-slim", dockerfile, re.M)
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


def test_pip_install_includes_every_package():
    """`pip install .` (the image) installs only the packages setuptools finds with
    pyproject's settings: a missing subpackage works in the source tree and breaks only
    in the container."""
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    listed = set(find_packages(where=str(ROOT), include=find["include"]))
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("api", "cli", "shared", "worker")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"setuptools would leave out: {sorted(found - listed)}"
    assert not any(p.startswith(("tests", "bench", "scripts")) for p in listed)
