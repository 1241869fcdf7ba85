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
