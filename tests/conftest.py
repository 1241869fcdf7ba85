import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))


@pytest.fixture(scope="module")
def pool4(tmp_path_factory):
    from harness import DistPool

    pool = DistPool(4, str(tmp_path_factory.mktemp("pool4")))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2(tmp_path_factory):
    from harness import DistPool

    pool = DistPool(2, str(tmp_path_factory.mktemp("pool2")))
    yield pool
    pool.close()
