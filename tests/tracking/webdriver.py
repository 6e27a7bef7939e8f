"""A headless Chromium driven through chromedriver's W3C WebDriver HTTP API (the standard library only: no selenium).

    with Browser() as browser:
        browser.open(url)
        browser.wait_for(lambda: "Run Name" in browser.text(), timeout_s=30)

Chromium and chromedriver come from Debian (tools/system-deps.sh). `available()` says why not when they are missing.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def _binaries() -> tuple[str | None, str | None]:
    browser = next((found for name in CHROMIUM if (found := shutil.which(name))), None)
    return browser, shutil.which("chromedriver")


def available() -> str | None:
    """None when a browser and chromedriver are installed, else what is missing."""
    browser, driver = _binaries()
    missing = [name for name, path in (("chromium", browser), ("chromedriver", driver)) if path is None]
    return f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver)" if missing else None


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        self.browser, self.driver = _binaries()
        self.size = (width, height)
        self.proc: subprocess.Popen | None = None
        self.session: str | None = None

    def __enter__(self) -> Browser:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([self.driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self._call("GET", "/status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__()
                    raise
                time.sleep(0.1)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={self.size[0]},{self.size[1]}"]
        caps = {"browserName": "chrome", "goog:chromeOptions": {"binary": self.browser, "args": args}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.session:
                self._call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        finally:
            if self.proc is not None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, method=method, data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def url(self) -> str:
        return self._call("GET", f"/session/{self.session}/url")

    def run(self, script: str, *args: Any) -> Any:
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": list(args)})

    def screenshot(self) -> bytes:
        """The viewport as PNG bytes (what is drawn, frames included)."""
        import base64

        return base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot"))

    def text(self) -> str:
        return self.run("return document.body ? document.body.innerText : ''")

    def wait_for(self, condition: Callable[[], Any], timeout_s: float = 120.0, what: str = "the page") -> Any:
        """Poll `condition` until it returns something true; AssertionError with the page's text on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = condition()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not shown within {timeout_s:g} s at {self.url()}:\n{self.text()[:2000]}")
            time.sleep(0.5)
