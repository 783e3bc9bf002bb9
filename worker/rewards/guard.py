"""The network guard of reward calls: every connection goes to an address MTQ_REWARD_HOSTS
allows (checked on the resolved address the socket then connects to; this host's own addresses
only as an exact address:port), within the call's deadline, and stops when the job is cancelled."""

import math
import socket
import time
from typing import Any, Callable

import httpcore
import httpx

from shared.reward_specs import address_allowed
from worker.rewards.batch import RewardError, RewardStopped

# While waiting on a reward server, the job's cancel flag is looked at this often.
STOP_POLL_S = 0.25

Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def resolve_host(host: str, port: int) -> list[str]:
    """The host's IP addresses (an IP literal resolves to itself)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class CallGuard(httpcore.SyncBackend):
    """httpcore's network backend for reward calls. It resolves the host itself, checks
    every address against MTQ_REWARD_HOSTS, and connects the socket to a checked address,
    so DNS cannot answer one thing to the check and another to the connection (rebinding).
    Every read and write honours the current call's deadline (connect + all reads: a
    server trickling bytes cannot stretch it) and stops when should_stop() says so."""

    def __init__(self, allowed_hosts: tuple[str, ...], resolver: Resolver):
        self.allowed_hosts = allowed_hosts
        self.resolver = resolver
        self.deadline = math.inf
        self.should_stop: Callable[[], bool] = lambda: False

    def time_left(self, timeout: float | None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("the reward call's deadline passed")
        if self.should_stop():
            raise RewardStopped()
        return min(left, STOP_POLL_S) if timeout is None else min(left, STOP_POLL_S, timeout)

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            addresses = self.resolver(host, port)
        except OSError as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from e
        refused = [a for a in addresses if not address_allowed(a, port, self.allowed_hosts)]
        if refused or not addresses:
            raise RewardError(
                f"reward host {host!r} resolves to {refused[0] if refused else 'no address'}, which MTQ_REWARD_HOSTS "
                f"does not allow ({','.join(self.allowed_hosts)})"
            )
        connect_timeout = min(self.deadline - time.monotonic(), timeout or math.inf)
        if connect_timeout <= 0:
            raise httpcore.ConnectTimeout("the reward call's deadline passed")
        error: Exception | None = None
        for address in addresses:
            try:
                stream = super().connect_tcp(address, port, connect_timeout, local_address, socket_options)
                return GuardedStream(stream, self)
            except httpcore.ConnectError as e:
                error = e
        raise error  # type: ignore[misc]


class GuardedStream(httpcore.NetworkStream):
    """A connection whose reads wait in short slices, so the call's deadline and the job's
    cancel are looked at while a server keeps us waiting."""

    def __init__(self, stream: httpcore.NetworkStream, guard: CallGuard):
        self.stream, self.guard = stream, guard

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        started = time.monotonic()
        while True:
            try:
                return self.stream.read(max_bytes, self.guard.time_left(timeout))
            except httpcore.ReadTimeout:
                if timeout is not None and time.monotonic() - started >= timeout:
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        left = self.guard.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.WriteTimeout("the reward call's deadline passed")
        self.stream.write(buffer, left if timeout is None else min(left, timeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> "GuardedStream":
        left = max(self.guard.deadline - time.monotonic(), 0.001)
        return GuardedStream(self.stream.start_tls(ssl_context, server_hostname, left if timeout is None else min(left, timeout)), self.guard)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


def guarded_client(guard: CallGuard) -> httpx.Client:
    """An httpx client whose connections all go through the guard. No proxies from the
    environment (a proxy would resolve the host itself), no redirects."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx has no option for httpcore's network backend, so its pool is made again with one.
    transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), network_backend=guard)
    return httpx.Client(transport=transport, trust_env=False, follow_redirects=False)

