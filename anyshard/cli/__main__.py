"""``python -m anyshard.cli``: the ``anyshard`` command."""

import sys

from anyshard.cli import main

sys.exit(main())
