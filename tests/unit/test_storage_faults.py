"""Random faults on the way to S3: every save and load completes correctly through retries or
fails with StorageError; never a committed checkpoint that is corrupt."""

import pytest
import torch

import anyshard
from anyshard.errors import StorageError
from anyshard.reshard.verify import verify_checkpoint


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "step": seed,
    }


@pytest.mark.parametrize("seed", [1, 2])
def test_saves_and_loads_survive_random_faults_on_a_fifth_of_requests(s3_proxy, monkeypatch, seed):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries off: anyshard's are tested
    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", "20")
    monkeypatch.setenv("ANYSHARD_STORAGE_ATTEMPT_TIMEOUT", "0.5")
    s3_proxy.stall_seconds = 1.0
    s3_proxy.random_faults(0.2, seed=seed)
    outcomes = []
    for k in range(3):
        url = f"{s3_proxy.bucket}/run/step-{k}"
        want = state(10 * seed + k)
        try:
            anyshard.save(url, want)
            got = {"w": torch.empty(300, 64), "b": torch.empty(64, dtype=torch.bfloat16), "step": 0}
            anyshard.load(url, got)
        except StorageError as e:
            outcomes.append(f"failed: {e}")
        else:
            assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
            assert got["step"] == want["step"]
            outcomes.append("ok")
    total = len(s3_proxy.requests())
    assert s3_proxy.injected >= 0.1 * total, (s3_proxy.injected, total)
    s3_proxy.rate = 0.0
    for k in range(3):  # whatever committed is intact
        url = f"{s3_proxy.bucket}/run/step-{k}"
        try:
            report = verify_checkpoint(url)
        except anyshard.errors.CheckpointNotFoundError:
            assert outcomes[k].startswith("failed"), outcomes
        else:
            assert report.tensors == 2
    assert outcomes.count("ok") >= 1, outcomes


def _flaky(seconds: float, failures: int, moves: bool):
    """An attempt that fails ``failures`` times, each after ``seconds`` (moving one byte each
    time when ``moves``), then succeeds; and the count of bytes moved."""
    import time

    failed, moved = [0], [0]

    def attempt(timeout: float) -> str:
        time.sleep(seconds)
        if failed[0] < failures:
            failed[0] += 1
            moved[0] += int(moves)
            raise ConnectionError("injected")
        return "ok"

    return attempt, (lambda: moved[0])


def test_the_deadline_counts_from_the_last_attempt_that_moved_bytes(monkeypatch):
    from anyshard.format import object_store

    monkeypatch.setenv("ANYSHARD_STORAGE_DEADLINE", "1.0")
    monkeypatch.setattr(object_store, "FIRST_BACKOFF", 0.01)
    # 6 failures of 0.3 s each: 1.8 s in all, past the deadline, but each one moved bytes
    attempt, progress = _flaky(0.3, 6, moves=True)
    assert object_store.retry("s3://b/k", "read", attempt, progress=progress) == "ok"
    # the same failures without progress end at the deadline
    attempt, progress = _flaky(0.3, 6, moves=False)
    with pytest.raises(StorageError, match="deadline"):
        object_store.retry("s3://b/k", "read", attempt, progress=progress)
