"""Regenerate the version-1 golden checkpoint (only when the format changes on purpose):

python tests/golden/make_v1.py
"""

import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


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


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import anyshard

    out = os.path.join(HERE, "v1")
    shutil.rmtree(out, ignore_errors=True)
    anyshard.save(out, golden_state())
    print("wrote", out)
