"""Headless Chromium (Debian's `chromium`) driven over its DevTools protocol, for the web page
tests: navigate, evaluate JavaScript, read the DOM, take screenshots."""

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import websocket


class Browser:
    def __init__(self, profile_dir: Path, width: int = 1400, height: int = 1100):
        mac = "/Applications/Chromium.app/Contents/MacOS/Chromium"
        exe = shutil.which("chromium") or shutil.which("chromium-browser") or (mac if os.path.exists(mac) else None)
        assert exe, "chromium is not installed (scripts/setup.sh installs it: apt install chromium)"
        profile_dir.mkdir(parents=True, exist_ok=True)
        # --no-sandbox: the tests may run as root (CI does), where Chromium's sandbox refuses to start.
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-port=0", f"--user-data-dir={profile_dir}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        port_file = profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, f"chromium exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its debugging port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def send(self, method: str, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:  # other messages are events: not needed here
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && location.href.startsWith(%s)" % json.dumps(url.split("#")[0]))

    def wait(self, expression: str, timeout: float = 30):
        """Until the expression is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.eval(expression)
            except RuntimeError:
                value = None  # e.g. the page is still loading
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.kill()
            self.proc.wait(10)
