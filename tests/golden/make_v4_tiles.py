"""Regenerate the golden checkpoint of data file version 4 (checksum tiles of shards of 3 and 4
dims: each tiled as the 2-d array of its rows, every dim but the last flattened); only when the
format changes on purpose:

python tests/golden/make_v4_tiles.py
"""

import os
import shutil
import sys

import torch


def tiles_nd_state() -> dict:
    """An expert weight [experts, rows, cols] of 128 KiB (2 x 8 rows of 8 KiB: checksum blocks
    of one expert, 8 rows, 16 column blocks of 512 bytes) and a 4-d tensor of 128 KiB (2 x 2 x
    4 rows of 8 KiB: blocks of 8 rows, across its dim 1); their values exact in fp32."""
    experts = torch.arange(2 * 8 * 2048, dtype=torch.float32).reshape(2, 8, 2048) * 0.25 - 100.0
    stacked = torch.arange(2 * 2 * 4 * 2048, dtype=torch.float32).reshape(2, 2, 4, 2048) * -0.5
    return {"experts": experts, "stacked": stacked}


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import anyshard

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v4-tiles")
    shutil.rmtree(out, ignore_errors=True)
    anyshard.save(out, tiles_nd_state())
    print("wrote", out)
