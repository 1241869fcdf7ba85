"""A read plan and its parts: the transfers that fill target regions from stored shards, the
stored shards' byte ranges and checksums, and the requests (byte-range reads) that carry them out.

`anyshard.reshard.planner` makes plans, `anyshard.reshard.executor` runs them. Pure data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from anyshard.geometry.boxes import Piece, box_numel

__all__ = [
    "GAP",
    "STAGING",
    "TARGET",
    "ReadPlan",
    "Request",
    "ShardCheck",
    "StoredShardInfo",
    "Transfer",
]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``src`` (a piece of the stored tensor ``fqn`` in ``rank``'s file) to ``dst``
    (a piece of target tensor number ``target``); both hold the same logical box.

    ``fqn`` is the key the shard is stored under: the logical name, or under a spec the local
    name of the tensor that rank saved."""

    fqn: str
    target: int
    rank: int
    src: Piece
    dst: Piece
    # Set when the read was widened to whole checksum blocks: ``src`` is then the run of whole
    # blocks read (a flat piece), staged, and ``window`` the needed piece within that run. Or,
    # widened to whole tiles: ``src`` is the box of tiles read, of the shard's 2-d array of rows
    # (every dim but the last flattened; staged in C order), and ``tiles`` = ``(band, width,
    # crcs)``: the box cut into tiles of ``band`` rows (the last band possibly shorter) by
    # ``width`` columns, the crc32c of each, row-major. The window of a shard of 3 or more dims
    # has the shard's dims, its last the staged columns, and a ``base`` that may be negative:
    # where the shard's row 0 would lie, the staged rows beginning at the first tile's.
    window: Piece | None = None
    tiles: tuple[int, int, tuple[int, ...]] | None = None

    @property
    def numel(self) -> int:
        return box_numel(self.src.array_box)


@dataclass(frozen=True, slots=True)
class StoredShardInfo:
    """A stored shard's bytes in its file and the crc32c of each of its checksum blocks of
    ``block`` bytes (the last one possibly shorter), as the file's header gives them; without
    ``block``, the whole shard is one block whose crc32c is ``crc32c``."""

    start: int
    stop: int
    itemsize: int
    crc32c: int = 0
    block: int | None = None
    crcs: tuple[int, ...] | None = None
    # tiles: the last dim in ``tiles`` column blocks, the crc32c of each (block, column block);
    # a shard of 3 or more dims tiled as the 2-d array of its rows
    tiles: int = 1
    tile_crcs: tuple[int, ...] = ()

    @property
    def block_bytes(self) -> int:
        return self.block if self.block is not None else max(self.stop - self.start, 1)

    @property
    def block_crcs(self) -> tuple[int, ...]:
        return self.crcs if self.crcs is not None else (self.crc32c,)


class ShardCheck(NamedTuple):
    """Bytes ``[start, stop)`` of a request are part of stored shard number ``shard``."""

    shard: int
    start: int
    stop: int


GAP, TARGET, STAGING = 0, 1, 2


class Request(NamedTuple):
    """One read of ``length`` bytes at ``offset`` of ``rank``'s file.

    ``spans`` place the bytes, in file order, as ``(kind, transfer, offset, n)``: ``TARGET``
    straight into the memory of the transfer's target tensor at byte ``offset``; ``STAGING`` into
    the transfer's staging buffer (its box in C order) at byte ``offset``; ``GAP`` bytes read
    through and dropped (coalescing; ``transfer`` is -1).

    ``repeat = (count, file_stride, dest_stride)`` makes a request stand for ``count`` reads of a
    single span, the k-th at ``offset + k * file_stride`` into ``offset + k * dest_stride`` of the
    span's destination: the rows of a strided region, planned and run without an object each.

    ``rows = (target, first, stride, n)`` says what the planner found of the spans: they are
    all ``TARGET`` spans of ``n`` bytes into target tensor number ``target``, the k-th at byte
    ``first + k * stride`` (``stride >= n``), with no gap between them; ``staged`` says whether a
    span is ``STAGING``. The executor reads them instead of walking the spans.
    """

    rank: int
    offset: int
    length: int
    spans: tuple[tuple[int, int, int, int], ...]
    checks: tuple[ShardCheck, ...] = ()
    repeat: tuple[int, int, int] | None = None
    rows: tuple[int, int, int, int] | None = None
    staged: bool = True

    @property
    def count(self) -> int:
        return 1 if self.repeat is None else self.repeat[0]


@dataclass(slots=True)
class ReadPlan:
    transfers: list[Transfer]
    direct: list[bool]  # transfer i reads straight into the target's memory
    batches: list[list[Request]]  # executed one after another; bounded staging memory each
    shards: list[tuple[int, str, int, int, int]] = field(
        default_factory=list
    )  # rank, fqn, start, stop, crc

    @property
    def requests(self) -> list[Request]:
        return [r for b in self.batches for r in b]

    @property
    def bytes_read(self) -> int:
        return sum(r.length * r.count for r in self.requests)

    @property
    def bytes_needed(self) -> int:
        return sum(n * r.count for r in self.requests for kind, _, _, n in r.spans if kind != GAP)
