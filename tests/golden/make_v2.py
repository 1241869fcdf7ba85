"""How the version-2 golden checkpoint was made, while data files were version 2 (kept as it
is since: tests/golden/make_v3.py writes the newest).

python tests/golden/make_v2.py  # with an anyshard that writes version 2
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_v1 import write_golden

    write_golden("v2")
