"""How the version-2 golden checkpoint was made, while data files were version 2 (kept as it
is since: tests/golden/make_v3.py writes the newest).

python tests/golden/make_v2.py  # with an anyshard that writes version 2
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
