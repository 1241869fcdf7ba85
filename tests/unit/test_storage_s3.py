"""Checkpoints on s3:// against a real S3-compatible server (moto's, on loopback): round trips
bit-exact, clear errors for damaged checkpoints, the manifest as the commit, streamed multipart
writes, coalesced ranged reads, and retries of transient failures until a deadline.

The endpoint and credentials reach the code the standard way (AWS_* environment variables set
by the ``s3`` fixture), never through arguments. Run: python -m pytest tests/unit/test_storage_s3.py -q
"""

from __future__ import annotations

import time

import pytest
import torch

import anyshard
from anyshard._compat import s3_request
from anyshard.cli import main as cli
from anyshard.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from anyshard.format import object_store, ranged_reads, storage
from anyshard.reshard.verify import verify_checkpoint


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 19, generator=g),
        "half": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.int32),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.arange(6) % 2 == 0,
        "meta": {"step": 7, "lr": 0.5, "names": ["a", "b"]},
    }


def blank(state: dict) -> dict:
    """Targets of the same shapes and dtypes, filled with values that differ from the saved."""
    out: dict = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            out[k] = None
        elif v.dtype == torch.bool:
            out[k] = ~v
        else:
            out[k] = torch.full_like(v, -1)
    return out


def s3fs_of():
    import s3fs

    return s3fs.S3FileSystem()


def test_save_then_load_open_and_verify_on_s3_are_bit_exact(s3):
    url = f"{s3}/ckpt/step-1"
    state = sample_state()
    anyshard.save(url, state)

    loaded = blank(state)
    anyshard.load(url, loaded)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
        else:
            assert loaded[k] == v
    with anyshard.open(url) as view:
        assert sorted(view.keys()) == sorted(k for k, v in state.items() if torch.is_tensor(v))
        assert torch.equal(view.get_tensor("half"), state["half"])
        assert torch.equal(view.get_slice("w")[3:30, 2:11], state["w"][3:30, 2:11])
        assert torch.equal(view.get_slice("w")[5], state["w"][5])
        assert view.get_tensor("scalar").shape == () and view.get_tensor("empty").shape == (0, 4)
        assert view.get_value("meta") == state["meta"]
    report = verify_checkpoint(url)
    tensors = [v for v in state.values() if torch.is_tensor(v)]
    assert report.bytes_checked == sum(t.numel() * t.element_size() for t in tensors)


def test_cli_inspects_and_verifies_an_s3_url(s3, capsys):
    url = f"{s3}/ckpt/step-2"
    anyshard.save(url, sample_state())
    assert cli(["inspect", url]) == 0
    assert "half" in capsys.readouterr().out
    assert cli(["verify", url]) == 0


def test_a_missing_data_object_is_a_corrupt_checkpoint_naming_it(s3):
    url = f"{s3}/ckpt/step-1"
    state = sample_state()
    anyshard.save(url, state)
    data = f"{url}/data/rank-00000.safetensors"
    s3fs_of().rm(data)
    for action in (lambda: anyshard.load(url, blank(state)), lambda: verify_checkpoint(url)):
        with pytest.raises(CorruptCheckpointError, match="data file is missing") as info:
            action()
        assert data in str(info.value)


def test_a_truncated_data_object_is_a_corrupt_checkpoint(s3):
    url = f"{s3}/ckpt/step-1"
    state = sample_state()
    anyshard.save(url, state)
    data = f"{url}/data/rank-00000.safetensors"
    fs = s3fs_of()
    fs.pipe_file(data, fs.cat_file(data)[:-40])
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        anyshard.load(url, blank(state))
    assert data in str(info.value)


def test_a_prefix_without_manifest_is_not_a_committed_checkpoint(s3):
    url = f"{s3}/ckpt/step-1"
    anyshard.save(url, sample_state())
    s3fs_of().rm(f"{url}/manifest.json")  # as an interrupted save leaves it
    for action in (lambda: anyshard.open(url), lambda: anyshard.load(url, {})):
        with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
            action()
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        anyshard.open(f"{s3}/ckpt/step-404")


def test_saving_over_a_committed_checkpoint_on_s3_is_refused(s3):
    url = f"{s3}/ckpt/step-1"
    anyshard.save(url, {"w": torch.ones(3)})
    with pytest.raises(anyshard.errors.SaveError, match="already holds a committed checkpoint"):
        anyshard.save(url, {"w": torch.zeros(3)})
    assert torch.equal(anyshard.open(url).get_tensor("w"), torch.ones(3))


def test_the_manifest_is_written_after_every_data_object_is_complete(s3_proxy, monkeypatch):
    monkeypatch.setattr(object_store, "PART_BYTES", 5 << 20)  # S3's smallest part: several parts
    url = f"{s3_proxy.bucket}/ckpt/step-1"
    big = torch.randn(3 << 20)  # 12 MiB: a multipart upload of 3 parts
    anyshard.save(url, {"big": big, "small": torch.arange(4)})

    events = s3_proxy.events
    key = url.removeprefix("s3:/")
    manifest_put = [
        i for i, e in enumerate(events) if e == ("start", "PUT", f"{key}/manifest.json")
    ]
    data_done = [
        i
        for i, (kind, method, path) in enumerate(events)
        if kind == "end" and path.startswith(f"{key}/data/") and method in ("PUT", "POST")
    ]
    parts = [p for p in s3_proxy.requests("PUT") if "partNumber=" in p]
    assert len(manifest_put) == 1 and len(parts) == 3 and data_done
    assert manifest_put[0] > max(data_done)  # nothing of the data is written after the commit
    assert torch.equal(anyshard.open(url).get_tensor("big"), big)


def test_a_failed_streamed_write_leaves_no_object_and_no_pending_upload(s3, monkeypatch):
    monkeypatch.setattr(object_store, "PART_BYTES", 5 << 20)
    url = f"{s3}/obj"
    with pytest.raises(RuntimeError, match="writer failed"):
        with storage.open_writer(url) as f:
            f.write(memoryview(bytearray(12 << 20)))
            raise RuntimeError("writer failed")
    assert not storage.exists(url)
    bucket = s3.removeprefix("s3://")
    request = s3_request(s3fs_of())
    assert request is not None
    assert not request("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_scattered_rows_are_read_with_few_ranged_requests(s3_proxy):
    url = f"{s3_proxy.bucket}/blob"
    blob = bytes(range(256)) * 4096  # 1 MiB
    storage.write_bytes_atomic(url, blob)
    rows = [(k * 1000, memoryview(bytearray(100))) for k in range(1000)]  # 1000 strided rows
    before = len(s3_proxy.requests("GET"))
    with storage.FileReader(url) as reader:
        reader.read_scattered(rows)
    assert len(s3_proxy.requests("GET")) - before == 1  # near rows share one GET
    for offset, buf in rows:
        assert bytes(buf) == blob[offset : offset + 100]


def test_a_large_read_streams_one_ranged_request_per_block(s3_proxy, monkeypatch):
    url = f"{s3_proxy.bucket}/blob"
    blob = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8).numpy().tobytes()
    storage.write_bytes_atomic(url, blob)
    buf = memoryview(bytearray(len(blob) - 10))
    with storage.FileReader(url) as reader:
        reader.read_into(10, buf)
        assert s3_proxy.ranges[-1:] == [f"bytes=10-{len(blob) - 1}"]  # one GET, streamed
        assert bytes(buf) == blob[10:]
        monkeypatch.setattr(ranged_reads, "MAX_STREAM", 16 << 20)
        before = len(s3_proxy.ranges)
        buf = memoryview(bytearray(len(blob) - 10))
        reader.read_into(10, buf)
        assert sorted(s3_proxy.ranges[before:]) == sorted(
            f"bytes={a}-{min(a + (16 << 20), len(blob)) - 1}"
            for a in (10, 10 + (16 << 20), 10 + (32 << 20))
        )
        assert bytes(buf) == blob[10:]
        with pytest.raises(EOFError):
            reader.read_into(len(blob) - 4, memoryview(bytearray(8)))
        with pytest.raises(EOFError):
            reader.read_into(len(blob) + 4, memoryview(bytearray(8)))


def test_a_streamed_read_cut_midway_goes_on_from_the_byte_it_reached(s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"{s3_proxy.bucket}/blob"
    blob = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    storage.write_bytes_atomic(url, blob)
    rows = [(k << 20, memoryview(bytearray(1 << 19))) for k in range(12)]  # half of each MiB
    before = len(s3_proxy.ranges)
    s3_proxy.fail_next("cut")
    with storage.FileReader(url) as reader:
        reader.read_scattered(rows)
    for offset, buf in rows:
        assert bytes(buf) == blob[offset : offset + len(buf)]
    first, *rest = s3_proxy.ranges[before:]
    assert first == f"bytes=0-{(11 << 20) + (1 << 19) - 1}"
    assert len(rest) == 1 and rest[0].endswith(f"-{(11 << 20) + (1 << 19) - 1}")
    resumed_at = int(rest[0].removeprefix("bytes=").split("-")[0])
    assert resumed_at > 0  # not from the start: what arrived before the cut was kept


def test_a_streamed_read_cut_inside_a_span_fills_the_rest_of_it(s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"{s3_proxy.bucket}/blob"
    blob = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
    storage.write_bytes_atomic(url, blob)
    buf = memoryview(bytearray(len(blob) - 100))
    before = len(s3_proxy.ranges)
    s3_proxy.fail_next("cut")  # half of the answer arrives: the cut falls inside the one span
    with storage.FileReader(url) as reader:
        reader.read_into(100, buf)
    assert bytes(buf) == blob[100:]
    first, again = s3_proxy.ranges[before:]
    assert first == f"bytes=100-{len(blob) - 1}"
    assert 100 < int(again.removeprefix("bytes=").split("-")[0]) < len(blob)


def test_overlapping_spans_are_each_filled(s3_proxy):
    url = f"{s3_proxy.bucket}/blob"
    blob = bytes(range(256)) * 64
    storage.write_bytes_atomic(url, blob)
    spans = [(100, memoryview(bytearray(1000))), (200, memoryview(bytearray(100)))]
    spans.append((150, memoryview(bytearray(50))))
    with storage.FileReader(url) as reader:
        reader.read_scattered(spans)
    for offset, buf in spans:
        assert bytes(buf) == blob[offset : offset + len(buf)]


def test_strided_rows_from_s3_stream_in_one_get(s3_proxy, monkeypatch):
    from anyshard.format.manifest import read_manifest
    from anyshard.geometry.boxes import Piece
    from anyshard.reshard import executor
    from anyshard.reshard.fill import Fill, fill_regions

    monkeypatch.setattr(executor, "_BOUNCE_BYTES", 5 * 16)  # locally: 13 parts of 5 rows
    url = f"{s3_proxy.bucket}/ckpt"
    full = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    anyshard.save(url, {"w": full})
    dest = torch.full((64, 8), -1.0)  # stored rows land in columns 2..6: 64 strided rows
    piece = Piece(0, (64, 8), ((0, 64), (2, 6)), ((0, 64), (0, 4)))
    manifest = read_manifest(url)
    before = len(s3_proxy.ranges)
    fill_regions(url, manifest, [Fill("w", dest, (piece,))])
    assert (
        torch.equal(dest[:, 2:6], full) and (dest[:, :2] == -1).all() and (dest[:, 6:] == -1).all()
    )
    data_gets = [r for r in s3_proxy.ranges[before:] if not r.startswith("bytes=0-")]
    assert len(data_gets) == 1  # headers are read from byte 0; the rows in one streamed GET


def test_a_server_that_ignores_ranges_is_an_error_not_wrong_bytes(s3_proxy):
    url = f"{s3_proxy.bucket}/blob"
    storage.write_bytes_atomic(url, bytes(range(256)) * 64)
    s3_proxy.fail_next("norange")
    buf = memoryview(bytearray(100))
    with storage.FileReader(url) as reader:
        with pytest.raises(StorageError, match="does not serve byte ranges"):
            reader.read_into(1000, buf)
        reader.read_into(1000, buf)  # the next answer honours the range
    assert bytes(buf) == (bytes(range(256)) * 64)[1000:1100]


def test_transient_server_errors_are_retried_until_the_save_and_load_succeed(s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no retries inside botocore: anyshard's own
    url = f"{s3_proxy.bucket}/ckpt/step-1"
    state = sample_state()
    s3_proxy.fail_next("503", "500", "503")
    anyshard.save(url, state)
    s3_proxy.fail_next("500", "503", "drop", "503")
    loaded = blank(state)
    anyshard.load(url, loaded)
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if torch.is_tensor(v))
    assert verify_checkpoint(url).tensors == 6


def test_a_failure_that_persists_raises_storage_error_at_the_deadline(s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    # a deadline with room for several answered requests on a loaded machine (at 1.5 s, one
    # slow first request could use all of it and end in a timeout instead of a 503)
    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", "4")
    url = f"{s3_proxy.bucket}/ckpt/step-1/manifest.json"
    s3_proxy.always = "503"
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.read_bytes(url)
    assert time.monotonic() - start < 12
    message = str(info.value)
    assert url in message and "ANYSHARD_STORAGE_DEADLINE=4" in message
    assert "last error: HTTP 503" in message
    assert len(s3_proxy.requests("GET")) >= 3  # retried, with backoff, before giving up


def test_an_error_that_retrying_cannot_fix_is_raised_at_once(s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", "60")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    start = time.monotonic()
    with pytest.raises(StorageError, match=f"{s3}/x"):
        storage.write_bytes_atomic(f"{s3}/x", b"data")
    assert time.monotonic() - start < 10


def test_writing_to_a_missing_bucket_says_so(s3):
    with pytest.raises(StorageError, match="bucket .*does not exist"):
        storage.write_bytes_atomic("s3://no-such-bucket-anyshard/x", b"data")


def test_objects_written_by_another_client_are_seen_despite_cached_listings(s3, s3_server):
    import boto3

    storage.write_bytes_atomic(f"{s3}/run/a", b"")
    assert storage.listdir(f"{s3}/run") == ["a"]  # s3fs now holds a listing of run/
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)  # another writer
    client.put_object(Bucket=s3.removeprefix("s3://"), Key="run/b", Body=b"xyz")
    assert storage.exists(f"{s3}/run/b") and storage.size(f"{s3}/run/b") == 3
    assert storage.listdir(f"{s3}/run") == ["a", "b"]
    assert storage.read_bytes(f"{s3}/run/a") == b"" and storage.read_bytes(f"{s3}/run/b") == b"xyz"


def test_save_and_load_through_another_fsspec_scheme(tmp_path):
    url = f"memory://anyshard-test/{tmp_path.name}/step-1"
    state = sample_state()
    anyshard.save(url, state)
    loaded = blank(state)
    anyshard.load(url, loaded)
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if torch.is_tensor(v))
    assert verify_checkpoint(url).tensors == 6


@pytest.mark.parametrize("where", ["s3", "local"])
def test_an_exclusive_write_never_replaces_an_existing_document(s3, tmp_path, where):
    path = f"{s3}/ckpt/manifest.json" if where == "s3" else str(tmp_path / "manifest.json")
    storage.write_bytes_atomic(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        storage.write_bytes_atomic(path, b"second", exclusive=True)
    assert storage.read_bytes(path) == b"first"
    storage.write_bytes_atomic(path, b"third")  # not exclusive: replaced whole
    assert storage.read_bytes(path) == b"third"


def test_a_stalled_request_is_cut_off_and_retried(s3_proxy, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("ANYSHARD_STORAGE_ATTEMPT_TIMEOUT", "0.5")
    url = f"{s3_proxy.bucket}/doc"
    storage.write_bytes_atomic(url, b"payload")
    s3_proxy.fail_next("stall")  # the server answers nothing for 5 s
    start = time.monotonic()
    assert storage.read_bytes(url) == b"payload"
    assert time.monotonic() - start < 3


def test_incremental_steps_with_retention_ls_gc_and_verify_over_s3(s3, capsys):
    """Incremental saves on an object store: references resolve against the bucket prefix,
    retention keeps the referenced objects, and ls, gc and verify work over s3://."""
    from anyshard.format.steps import list_steps
    from anyshard.trainer_integration import Checkpointer

    root = f"{s3}/run"
    g = torch.Generator().manual_seed(0)
    state = {"m": {"base": torch.randn(256, 64, generator=g), "ada": torch.zeros(4, 64)}}
    ckpt = Checkpointer(root, keep_last=2, incremental=True)
    for n in range(1, 5):
        state["m"]["ada"] += 1
        ckpt.save(n, state)
    ckpt.wait()
    listed = list_steps(root, refs=True)
    assert [(s.step, s.committed, s.referenced) for s in listed] == [
        (1, False, True),
        (3, True, False),
        (4, True, False),
    ]
    assert listed[-1].shared == 256 * 64 * 4
    capsys.readouterr()
    assert cli(["ls", root]) == 0 and "referenced" in capsys.readouterr().out
    assert cli(["gc", root]) == 0 and "kept" in capsys.readouterr().out
    assert cli(["verify", f"{root}/step-000000004"]) == 0
    fresh = {"m": {"base": torch.zeros(256, 64), "ada": torch.zeros(4, 64)}}
    assert Checkpointer(root).restore_latest(fresh) == 4
    assert torch.equal(fresh["m"]["base"], state["m"]["base"])
    assert torch.equal(fresh["m"]["ada"], state["m"]["ada"])


def test_a_column_slice_reads_whole_blocks_where_one_get_would_read_the_gaps_anyway(s3):
    """On object storage, ranges closer than 1 MiB share one GET, gap included: a 4-way split of
    16 KiB rows reads whole checksum blocks, not the tiles (docs/format.md) that would save
    nothing there."""
    from anyshard.format.manifest import read_manifest
    from anyshard.geometry.boxes import Piece
    from anyshard.reshard.fill import Fill, fill_regions

    w = torch.randn(512, 4096, generator=torch.Generator().manual_seed(1))  # 16 KiB rows
    url = f"{s3}/tiled"
    anyshard.save(url, {"w": w})
    dest = torch.empty(512, 1024)
    box = ((0, 512), (0, 1024))
    plan = fill_regions(
        url, read_manifest(url), [Fill("w", dest, (Piece(0, (512, 1024), box, box),))]
    )
    assert torch.equal(dest, w[:, :1024])
    assert plan.bytes_read == 4 * dest.numel() * 4
