"""crc32c checksums, and combining the checksums of adjacent byte ranges.

Combining lets a loader verify a shard that was read in several parallel requests without
reading it again: crc(A + B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B), computed in GF(2)
with a table of x^(2^k) mod P (the method of zlib's crc32_combine).
"""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["crc32c", "crc32c_combine"]

_POLY = 0x82F63B78  # Castagnoli, reflected


def crc32c(data, value: int = 0) -> int:
    return _crc32c.crc32c(data, value)


def _multmodp(a: int, b: int) -> int:
    """a * b mod P for reflected 32-bit polynomials."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()  # _X2N[k] = x^(2^k) mod P


def _x8n(n: int) -> int:
    """x^(8 n) mod P."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The crc32c of ``A + B`` from the crc32c of ``A``, of ``B`` and the length of ``B``."""
    if len_b <= 0:
        return crc_a
    if crc_a == 0:  # x^n * 0 is 0: the first part of a chain costs nothing
        return crc_b
    return _multmodp(_x8n(len_b), crc_a) ^ crc_b
