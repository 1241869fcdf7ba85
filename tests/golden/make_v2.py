"""Regenerate the version-2 golden checkpoint (only when the format changes on purpose):

python tests/golden/make_v2.py
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

    out = os.path.join(HERE, "v2")
    shutil.rmtree(out, ignore_errors=True)
    anyshard.save(out, golden_state())
    print("wrote", out)
