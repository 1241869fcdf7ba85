"""A real S3-compatible server for tests: moto's standalone server, on loopback only.

The server runs as its own process (``python -m moto.server``), so that its request handling
does not share the GIL of the test process. Code under test finds it the way a user's code
finds an endpoint: through the standard AWS_* environment variables from `MotoServer.env`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``with MotoServer() as server:`` runs moto's S3 on ``server.endpoint`` (127.0.0.1)."""

    def __init__(self, *, start_timeout: float = 30.0):
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment that points boto3/s3fs at this server, with dummy credentials."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe an instance-metadata service
            "AWS_CONFIG_FILE": os.devnull,  # the user's ~/.aws must not leak into tests
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def start(self) -> None:
        for _ in range(5):  # another process may take the free port before the server binds it
            self.port = _free_port()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_until_up():
                return
            self.stop()
        raise RuntimeError("moto's S3 server did not start on 127.0.0.1")

    def _wait_until_up(self) -> bool:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def create_bucket(self, prefix: str = "test") -> str:
        """A new, empty bucket; its name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return name

    def __enter__(self) -> MotoServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te"}


class S3Proxy:
    """An HTTP proxy on loopback between the code under test and the server: it records every
    request in order and injects faults on demand (error answers, dropped connections).

    ``with S3Proxy(server.endpoint) as proxy:`` then point AWS_ENDPOINT_URL at ``proxy.endpoint``.
    ``proxy.events`` holds ``("start" | "end", method, path)`` in the order they happened.
    """

    def __init__(self, upstream: str):
        import threading

        self.upstream = upstream.removeprefix("http://")
        self.events: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._faults: list[str] = []  # queued: "503", "500", "drop", "stall", "cut"
        self.ranges: list[str | None] = []  # the Range header of every GET, in order
        self.always: str | None = None  # a fault for every request, while set
        self.stall_seconds = 5.0  # how long a "stall" holds a request before dropping it
        self.rate = 0.0  # with random_faults(): the chance that a request gets a random fault
        self.injected = 0
        self._rng = None
        self._kinds: tuple[str, ...] = ()
        self._server = None
        self._thread = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, *faults: str) -> None:
        """Answer the next requests with these faults, one each: "503" or "500" (an S3 error
        answer), "drop" (close the connection), "stall" (answer nothing, then drop), "cut"
        (forward the request, answer the headers and half the body, then drop) or "norange"
        (forward it without its Range header, as a server that ignores ranges would)."""
        with self._lock:
            self._faults += faults

    def random_faults(
        self, rate: float, *, seed: int, kinds=("503", "500", "drop", "stall", "cut")
    ) -> None:
        """From now on, each request gets a fault drawn from ``kinds`` with chance ``rate``."""
        import random

        with self._lock:
            self.rate, self._rng, self._kinds = rate, random.Random(seed), tuple(kinds)

    def requests(self, method: str | None = None) -> list[str]:
        """Paths of the requests made so far, optionally of one method."""
        with self._lock:
            return [p for kind, m, p in self.events if kind == "start" and method in (None, m)]

    def _next_fault(self) -> str | None:
        with self._lock:
            fault = self._faults.pop(0) if self._faults else self.always
            if fault is None and self.rate and self._rng.random() < self.rate:
                fault = self._rng.choice(self._kinds)
            if fault is not None:
                self.injected += 1
            return fault

    def _record(self, kind: str, method: str, path: str) -> None:
        with self._lock:
            self.events.append((kind, method, path))

    def start(self) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def __enter__(self) -> S3Proxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _handler_class(self):
        import http.client
        from http.server import BaseHTTPRequestHandler

        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy._record("start", self.command, self.path)
                if self.command == "GET":
                    with proxy._lock:
                        proxy.ranges.append(self.headers.get("Range"))
                fault = proxy._next_fault()
                if fault in ("drop", "stall"):
                    if fault == "stall":
                        time.sleep(proxy.stall_seconds)
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if fault in ("500", "503"):
                    code = "InternalError" if fault == "500" else "ServiceUnavailable"
                    text = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(text)
                    proxy._record("end", self.command, self.path)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if fault == "norange":  # a server that ignores Range: the whole object, 200
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status, resp.reason)
                names = set()
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP and k.lower() not in ("server", "date"):
                        self.send_header(k, v)
                        names.add(k.lower())
                if "content-length" not in names:  # the upstream answer was chunked
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fault == "cut":  # the upstream acted on it; the answer breaks off midway
                    if self.command != "HEAD":
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)
                proxy._record("end", self.command, self.path)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
