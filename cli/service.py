"""`mtq worker --print-service launchd|systemd`: a service definition that runs this worker at
boot and starts it again when it dies (its jobs survive: they are re-queued), with the
settings of the current environment (REDIS_URL, MTQ_*). Install it as printed:

    mtq worker --print-service systemd | sudo tee /etc/systemd/system/mtq-worker.service
    sudo systemctl enable --now mtq-worker
    mtq worker --print-service launchd > ~/Library/LaunchAgents/com.mlx-train-queue.worker.plist
    launchctl load ~/Library/LaunchAgents/com.mlx-train-queue.worker.plist
"""

import os
import plistlib
import shlex
import sys

LABEL = "com.mlx-train-queue.worker"
STOP_GRACE_S = 60  # a warm shutdown checkpoints the running job and hands it back first


def worker_argv(options: list[str]) -> list[str]:
    return [sys.executable, "-m", "cli.main", "worker", *options]


def service_env() -> dict[str, str]:
    names = ("REDIS_URL", "PATH", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE")
    return {k: v for k, v in os.environ.items() if k.startswith("MTQ_") or k in names}


def systemd_unit(argv: list[str]) -> str:
    env = "\n".join(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(service_env().items()))
    return f"""[Unit]
Description=mlx-train-queue worker
After=network-online.target
Wants=network-online.target

[Service]
ExecStart={shlex.join(argv)}
WorkingDirectory={os.getcwd()}
{env}
Restart=always
RestartSec=5
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec={STOP_GRACE_S}

[Install]
WantedBy=multi-user.target
"""


def launchd_plist(argv: list[str]) -> str:
    logs = os.path.expanduser("~/Library/Logs/mtq-worker.log")
    plist = {"Label": LABEL, "ProgramArguments": argv, "WorkingDirectory": os.getcwd(),
             "EnvironmentVariables": service_env(), "RunAtLoad": True, "KeepAlive": True,
             "ExitTimeOut": STOP_GRACE_S, "StandardOutPath": logs, "StandardErrorPath": logs}
    return plistlib.dumps(plist).decode()


def print_service(kind: str, options: list[str]) -> int:
    argv = worker_argv(options)
    print(systemd_unit(argv) if kind == "systemd" else launchd_plist(argv), end="")
    return 0
