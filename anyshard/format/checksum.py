"""crc32c checksums, and combining the checksums of adjacent byte ranges.

Combining lets a loader verify a shard that was read in several parallel requests without
reading it again: crc(A + B) = combine(crc(A), crc(B), len(B)) (the zlib method, over GF(2)).
"""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["crc32c", "crc32c_combine"]

_POLY = 0x82F63B78  # Castagnoli, reflected


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def _times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, m) for m in mat]


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The crc32c of ``A + B`` from the crc32c of ``A``, of ``B`` and the length of ``B``."""
    if len_b <= 0:
        return crc_a
    odd = [_POLY] + [1 << i for i in range(31)]  # operator for one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    n = len_b
    while True:
        even = _square(odd)  # first pass: one zero byte
        if n & 1:
            crc_a = _times(even, crc_a)
        n >>= 1
        if not n:
            break
        odd = _square(even)
        if n & 1:
            crc_a = _times(odd, crc_a)
        n >>= 1
        if not n:
            break
    return crc_a ^ crc_b
