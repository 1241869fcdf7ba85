"""What the DCP writer and reader share: the checkpoint path a DCP call names, and DCP's
futures, which anyshard's writes and reads complete before they return."""

from __future__ import annotations

import os
from typing import Any

from torch.futures import Future

from anyshard.errors import AnyshardError


def checkpoint_path(checkpoint_id: str | os.PathLike | None, who: str) -> str:
    if checkpoint_id is None:
        raise AnyshardError(
            f"{who} needs the checkpoint's path or URL: {who}(path), or checkpoint_id=path"
        )
    return os.fspath(checkpoint_id)


def completed(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut
