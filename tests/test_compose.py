"""docker-compose.yml and the Dockerfile agree with the code and are safe by default
(checked without Docker: the file is parsed, and compose's ${VAR:?err} / ${VAR:-default}
interpolation is done here the way `docker compose config` does it)."""

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
SECRETS = {"MTQ_API_TOKEN": "api-secret-0123456789", "REDIS_PASSWORD": "redis-secret-0123456789"}
_VAR = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")


class MissingVariable(Exception):
    pass


def interpolate(node, env: dict):
    """compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR:?error} (refuses)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if not isinstance(node, str):
        return node

    def value(m: re.Match) -> str:
        name, kind, arg = m.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise MissingVariable(f"{name}: {arg}")
        return arg if kind == "-" else ""

    return _VAR.sub(value, node)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(raw) -> dict:
    return interpolate(raw, SECRETS)["services"]


def command(service: dict) -> list[str]:
    cmd = service["command"]
    return cmd.split() if isinstance(cmd, str) else cmd


def test_services_exist(services):
    assert {"redis", "api", "worker", "dashboard"} <= services.keys()


def test_redis_is_durable(services):
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    assert " ".join(command(redis)).startswith("redis-server") and "--appendonly yes" in " ".join(command(redis))
    assert any(v.endswith(":/data") for v in redis["volumes"])


@pytest.mark.parametrize("name,subcommand", [("api", "api"), ("worker", "worker"), ("dashboard", "dashboard")])
def test_api_and_worker_run_mtq_with_the_settings(services, name, subcommand):
    service = services[name]
    assert command(service)[:2] == ["mtq", subcommand]
    env = service["environment"]
    assert set(MTQ_ENV) <= env.keys()
    assert env["REDIS_URL"] == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"  # the password, in every service
    assert env["MTQ_API_TOKEN"] == SECRETS["MTQ_API_TOKEN"]  # from the host
    assert env["MTQ_HOME"] == "/data" and env["MTQ_MODELS_DIR"] == "/data/models"
    if name != "dashboard":
        assert "mtq-data:/data" in service["volumes"]  # models and adapters shared by api and worker
    assert service.get("build") == "."


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_secret(raw, missing):
    env = {k: v for k, v in SECRETS.items() if k != missing}
    with pytest.raises(MissingVariable, match=missing):
        interpolate(raw, env)


def test_no_secret_has_a_default(raw):
    text = (ROOT / "docker-compose.yml").read_text()
    assert "change-me" not in text
    for name in SECRETS:
        assert not re.search(rf"\$\{{{name}:-", text), f"{name} has a default"


def test_api_is_published_on_loopback_only(services):
    # Inside its container the API listens on every interface; the host publishes it on 127.0.0.1.
    assert "--host" in command(services["api"]) and "0.0.0.0" in command(services["api"])
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]
    assert services["dashboard"]["ports"] == ["127.0.0.1:9181:9181"]  # and behind the token (cli/dashboard.py)
    assert all("ports" not in services[name] for name in ("redis", "worker"))


def test_redis_requires_the_password(services):
    redis = services["redis"]
    cmd = command(redis)
    assert cmd[cmd.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] == SECRETS["REDIS_PASSWORD"]  # the healthcheck's redis-cli


def test_images_run_as_a_non_root_user(services):
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0", "0:0")
    assert all(services[name].get("user", "mtq") not in ("root", "0") for name in ("api", "worker", "dashboard"))


def test_env_names_are_the_ones_the_settings_read(services, monkeypatch):
    for name, value in services["api"]["environment"].items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.redis_url == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"
    assert settings.api_token == SECRETS["MTQ_API_TOKEN"]
    assert str(settings.home) == "/data" and str(settings.models_dir) == "/data/models"


@pytest.mark.parametrize("subcommand", ["api", "worker", "dashboard"])
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
