"""Imported by the warm launcher's forkserver (`launch.PRELOAD`): builds once what every rank
would otherwise build on its first restore, the parsers of the mapping language."""

from anyshard.ucl.library import preload

preload()
