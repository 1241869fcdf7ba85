"""Regenerate the version-3 golden checkpoint (data file version 3, manifest version 4: the
manifest and every data file header sealed with the crc32c of their own bytes); only when the
format changes on purpose:

python tests/golden/make_v3.py
"""

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    sys.path.insert(0, HERE)
    from make_v1 import golden_state

    import anyshard

    out = os.path.join(HERE, "v3")
    shutil.rmtree(out, ignore_errors=True)
    anyshard.save(out, golden_state())
    print("wrote", out)
