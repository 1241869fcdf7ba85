"""The state of the golden checkpoints. Version 1 (tests/golden/v1, data files with one crc32c
per shard) and version 2 (tests/golden/v2, one crc32c per checksum block) were written by
anyshard before later versions and are kept as they are; tests/golden/make_v3.py writes the
newest (data file version 3 and manifest version 4: their metadata sealed with its crc32c).
"""

import torch


def golden_state() -> dict:
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
            "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(7.0),
        },
        "step": 42,
        "config": {"lr": 0.5, "name": "golden"},
    }


def write_golden(name: str) -> None:
    """Write the golden state as the checkpoint tests/golden/NAME, with the anyshard of this
    checkout (the make_vN.py scripts run it for their version)."""
    import os
    import shutil
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", ".."))
    import anyshard

    out = os.path.join(here, name)
    shutil.rmtree(out, ignore_errors=True)
    anyshard.save(out, golden_state())
    print("wrote", out)
