import os
import sys

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (seeded from each test), so that a run of
# a clean clone tests what was tested before it landed. HYPOTHESIS_PROFILE=explore draws new
# examples each run, to look for failures (add what it finds with @example).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Bytecode is cached, as Python does by default, for this session and the interpreters it starts
# (launchers and their forkservers, CLI runs, tools: dozens, each compiling anyshard's 150
# modules again, 0.3-0.5 CPU s, where PYTHONDONTWRITEBYTECODE is set), and so are the test
# modules that pytest rewrites (the second xdist worker, and the next run, read them).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
sys.path.append(os.path.dirname(__file__))  # cli_runner, ft_events, s3_server


class _Pools:
    """The session's pools of gloo ranks, one per world size, spawned when first asked for and
    shared by the modules that follow (spawning 4 ranks that import torch costs 8-10 s on 2
    cores); a pool that a failed or timed-out task may have left out of step is replaced."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._pools: dict[int, object] = {}

    def get(self, world: int):
        from harness import DistPool

        pool = self._pools.get(world)
        if pool is None or not pool.healthy():
            if pool is not None:
                pool.close(kill=True)
            pool = DistPool(world, str(self._tmp.mktemp(f"pool{world}")))
            self._pools[world] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def dist_pools(tmp_path_factory):
    pools = _Pools(tmp_path_factory)
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def pool2(dist_pools):
    return dist_pools.get(2)


@pytest.fixture(scope="module")
def pool4(dist_pools):
    return dist_pools.get(4)


@pytest.fixture(scope="module")
def pool8(tmp_path_factory):
    """Eight ranks, for one module: spawned for it alone and closed after it."""
    from harness import DistPool

    pool = DistPool(8, str(tmp_path_factory.mktemp("pool8")))
    yield pool
    pool.close()


# --- S3 on loopback: SeaweedFS, a real object store; moto's mock behind the fault proxy ----------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS (master, volume server, filer, S3 gateway) on 127.0.0.1, started once for the
    whole session, its data in a temporary directory."""
    from anyshard.trainer_integration.demos.seaweed import SeaweedServer

    root = tmp_path_factory.mktemp("seaweedfs")
    with SeaweedServer(str(root)) as server:
        yield server


@pytest.fixture(scope="session")
def moto_server():
    """moto's standalone S3 server on 127.0.0.1: the mock behind `s3_proxy`'s injected faults."""
    from s3_server import MotoServer

    with MotoServer() as server:
        yield server


def _point_aws_at(endpoint_env: dict, monkeypatch) -> None:
    import s3fs

    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint_env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # instances remember the endpoint they were made with


@pytest.fixture
def s3(s3_server, monkeypatch):
    """``s3://<a fresh bucket>``, with the standard AWS_* environment pointing at the server."""
    import s3fs

    _point_aws_at(s3_server.env(), monkeypatch)
    yield "s3://" + s3_server.create_bucket()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_proxy(moto_server, monkeypatch):
    """An `S3Proxy` (request log, fault injection) in front of moto's server, with
    AWS_ENDPOINT_URL pointing at it; ``s3_proxy.bucket`` is ``s3://<a fresh bucket>``."""
    import s3fs
    from s3_server import S3Proxy

    with S3Proxy(moto_server.endpoint) as proxy:
        _point_aws_at({**moto_server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}, monkeypatch)
        proxy.bucket = "s3://" + moto_server.create_bucket()
        yield proxy
    s3fs.S3FileSystem.clear_instance_cache()


# Seconds each of the slowest files took in the last full runs on 2 cores (`pytest
# --durations=0`, summed per file; test_ft_hsdp.py less the 25 s its shorter jobs gave back).
# The two xdist workers take whole files in collection order
# (--no-loadscope-reorder in pyproject); the slowest go first, so that neither worker is left
# with a five-minute file when the other has finished (longest first: the classic greedy
# schedule). Files not listed keep their order after these.
_FILE_SECONDS = {
    "tests/e2e/test_ft_hsdp.py": 275,
    "tests/dist/test_trainer_elastic.py": 180,
    "tests/e2e/test_demo.py": 115,
    "tests/unit/test_crash_safety.py": 110,
    "tests/e2e/test_bench_tools.py": 90,
    "tests/e2e/test_trainer_fault.py": 85,
    "tests/dist/test_s3_reshard.py": 66,
    "tests/e2e/test_bench_tools_trainer.py": 65,
    "tests/unit/test_fuzz_checkpoints.py": 55,
    "tests/dist/test_trainer_torchtitan.py": 45,
    "tests/dist/test_trainer_megatron.py": 45,
    "tests/e2e/test_cli_and_demo.py": 32,
    "tests/dist/test_trainer_accelerate.py": 30,
    "tests/dist/test_dcp_backend.py": 25,
    "tests/dist/test_autolayout_jobs.py": 22,
}


def pytest_collection_modifyitems(config, items):
    def weight(item) -> int:
        return -_FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0)

    items.sort(key=weight)  # stable: a file's tests stay together and in order
