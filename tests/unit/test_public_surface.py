"""The public surface is exactly what docs/api.md documents."""

import os
import re

import anyshard
import anyshard.errors

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")


def test_every_public_name_is_documented_in_docs_api_md():
    text = open(DOC).read()
    documented = set(re.findall(r"`(?:anyshard\.)?([A-Za-z_][A-Za-z0-9_]*)", text))
    assert set(anyshard.__all__) - documented == set()
    assert set(anyshard.errors.__all__) - documented == set()


def test_every_name_in_all_exists():
    for name in anyshard.__all__:
        assert hasattr(anyshard, name), name
    for name in anyshard.errors.__all__:
        assert issubclass(getattr(anyshard.errors, name), anyshard.errors.AnyshardError), name
