"""crc32c checksums, combining the checksums of adjacent byte ranges, and sealed documents.

A sealed document (a manifest, a data file's JSON header) carries the crc32c of its own bytes:
it begins with a fixed prefix and 8 hex digits, the crc32c of the whole document as written
with those digits "00000000" (`seal`, `check_seal`). The seal is checked before anything in the
document is parsed.

Combining lets a loader verify a shard that was read in several parallel requests without
reading it again: crc(A + B) = crc(A) * x^(8 len(B)) mod P  xor  crc(B), computed in GF(2)
with a table of x^(2^k) mod P (the method of zlib's crc32_combine).
"""

from __future__ import annotations

import crc32c as _crc32c

from anyshard.errors import ChecksumError

__all__ = ["check_seal", "crc32c", "crc32c_combine", "seal"]

_UNSEALED = b"00000000"

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


def seal(data: bytes, prefix: bytes) -> bytes:
    """``data``, which begins with ``prefix`` and 8 placeholder digits "00000000", with those
    digits replaced by the crc32c (8 lowercase hex digits) of ``data`` as it is."""
    n = len(prefix)
    if data[: n + 8] != prefix + _UNSEALED:
        raise ValueError("the document does not begin with its prefix and the placeholder")
    return data[:n] + b"%08x" % crc32c(data) + data[n + 8 :]


def check_seal(data: bytes, prefix: bytes, where: str, what: str) -> None:
    """Raise `ChecksumError` naming ``where`` unless ``data`` (which begins with ``prefix``)
    holds the crc32c of its own bytes after ``prefix`` (see `seal`)."""
    n = len(prefix)
    stored = bytes(data[n : n + 8])
    crc = crc32c(_UNSEALED, crc32c(memoryview(data)[:n]))
    crc = crc32c(memoryview(data)[n + 8 :], crc)
    if len(stored) != 8 or stored != b"%08x" % crc:
        raise ChecksumError(
            f"{where}: the {what} does not match its checksum (crc32c {crc:08x}, stored "
            f"{stored.decode('ascii', 'replace')!r}); the file is corrupt. Restore it from a "
            "replica or load an earlier step"
        )
