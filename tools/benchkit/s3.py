"""An S3 server on loopback for a benchmark (`s3_server`: moto's or SeaweedFS), and a TCP relay
in front of it that counts the bytes the server sends (`Relay`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .measure import ROOT


@contextmanager
def s3_server(kind: str = "moto") -> Iterator[tuple[Any, list[int]]]:
    """An S3 server on 127.0.0.1 (``moto``'s, or ``seaweedfs``) for the ``with`` block, found
    through the AWS_* environment that is set for it: ``(server, its process ids)``."""
    if kind == "seaweedfs":
        from anyshard.trainer_integration.demos.seaweed import SeaweedServer as Server
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3_server import MotoServer as Server
    server: Any = Server()
    server.start()
    try:
        os.environ.update(server.env())
        # a loaded server answers slowly: no spurious retry should enter the times
        os.environ.setdefault("ANYSHARD_STORAGE_DEADLINE", "600")
        procs = list(server._procs.values()) if kind == "seaweedfs" else [server._proc]
        yield server, [p.pid for p in procs]
    finally:
        server.stop()


class Relay:
    """A TCP relay on 127.0.0.1 in front of ``port``; ``sent`` (shared with spawned processes)
    counts the bytes the server behind it sends."""

    def __init__(self, port: int):
        self.port, self.sent = port, mp.get_context("spawn").Value("q", 0)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # until closed
            while True:
                client, _ = self.sock.accept()
                threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.port)) as server:
            up = threading.Thread(target=self._copy, args=(client, server), daemon=True)
            up.start()
            self._copy(server, client, self.sent)
            up.join()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket, counter=None) -> None:
        buf = memoryview(bytearray(1 << 20))
        with contextlib.suppress(OSError):
            while n := src.recv_into(buf):
                if counter is not None:  # counted before the client can have it
                    with counter.get_lock():
                        counter.value += n
                dst.sendall(buf[:n])
        for s in (src, dst):  # either side closing ends both directions
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
