"""A real HTTP reward server for the tests: 127.0.0.1, the port MTQ_REWARD_HOSTS lists for them
(conftest.REWARD_PORT; one server at a time), a thread of its own."""

import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from conftest import CLOSED_PORT, REWARD_PORT


class RewardServer:
    """Answers each POST with `answer(body, k)` (k: the request's number). Scripted replies
    in `replies` come first (FIFO, one per request): {"delay": s} answers after s seconds,
    {"status": code} with that status, {"json": answer} or {"raw": text} with that body.
    `requests` records each request: path, headers, body, the rewards answered, delayed."""

    def __init__(self, answer: Callable[[dict, int], dict], port: int = REWARD_PORT):
        self.answer = answer
        self.requests: list[dict] = []
        self.replies: list[dict] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                server._handle(self)

            def log_message(self, *args):  # keep pytest's output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/reward"

    def _handle(self, handler: BaseHTTPRequestHandler):
        body = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", 0))))
        with self._lock:
            reply = self.replies.pop(0) if self.replies else {}
            answer = reply.get("json", self.answer(body, len(self.requests)))
            self.requests.append({
                "path": handler.path,
                "headers": {k.lower(): v for k, v in handler.headers.items()},
                "body": body,
                "answer": answer.get("rewards") if isinstance(answer, dict) else None,
                "delayed": "delay" in reply,
            })
        time.sleep(reply.get("delay", 0))
        payload = (reply["raw"] if "raw" in reply else json.dumps(answer)).encode()
        try:
            handler.send_response(reply.get("status", 200))
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped waiting (the timeout tests)


@contextmanager
def serving(answer: Callable[[dict, int], dict], port: int = REWARD_PORT):
    server = RewardServer(answer, port)
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


def slow_rewards(delay_s: float = 0.2) -> Callable[[dict, int], dict]:
    """An answer that takes delay_s (so that a job's steps take that long at least): request k
    gets reward k % 5 for each completion, a curve that moves."""
    def answer(body: dict, k: int) -> dict:
        time.sleep(delay_s)
        return {"rewards": [float(k % 5)] * len(body["completions"])}

    return answer


def closed_port_url() -> str:
    """A URL MTQ_REWARD_HOSTS allows and nobody listens on: connections are refused at once."""
    return f"http://127.0.0.1:{CLOSED_PORT}/reward"
