"""Regenerate the golden checkpoint of data file version 3 with checksum tiles (a 2-d shard's
column blocks checksummed on their own); only when the format changes on purpose:

python tests/golden/make_v3_tiles.py
"""

import os
import sys

import torch


def tiles_state() -> dict:
    """A 2-d tensor of 256 KiB (32 rows of 8 KiB): checksum blocks of 4 rows, 16 column blocks of
    512 bytes; its values exact in fp32."""
    return {"w": torch.arange(32 * 2048, dtype=torch.float32).reshape(32, 2048) * 0.25 - 100.0}


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import anyshard

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "v3-tiles")
    anyshard.save(out, tiles_state())
