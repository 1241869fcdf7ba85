"""Regenerate the version-3 golden checkpoint (data file version 3, manifest version 4: the
manifest and every data file header sealed with the crc32c of their own bytes); only when the
format changes on purpose:

python tests/golden/make_v3.py
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_v1 import write_golden

    write_golden("v3")
