"""The exception hierarchy: every error anyshard raises is an `AnyshardError`.

Messages say what was expected, what was found (names, paths, values) and one fix.
"""

from __future__ import annotations

__all__ = [
    "AnyshardError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "LayoutError",
    "MappingSyntaxError",
    "MappingError",
    "SaveError",
    "StateDictMismatchError",
    "StorageError",
    "UCLError",
    "UCLSemanticError",
    "UCLSyntaxError",
]


class AnyshardError(Exception):
    """Base class of every error raised by anyshard."""


class StorageError(AnyshardError, OSError):
    """A file or object could not be read or written (after retries where they apply)."""


class CheckpointNotFoundError(AnyshardError, FileNotFoundError):
    """The path holds no committed checkpoint (no manifest.json)."""


class CorruptCheckpointError(AnyshardError):
    """A checkpoint is committed but its files are missing, truncated or inconsistent."""


class ChecksumError(CorruptCheckpointError):
    """Bytes do not match their checksum: those of a stored shard against the checksum written
    at save time, or those one rank received from another against the checksum the sender
    computed (`anyshard.format.transit`).

    For bytes damaged in transit, ``tensor`` names the logical tensor, ``sender`` and
    ``receiver`` the ranks (in the process group of the call), and ``failures`` holds every
    mismatch found on any rank (dicts with those keys, plus ``box``, ``sent`` and ``got``, the
    two crc32c values); they are None (``failures`` empty) for stored bytes."""

    def __init__(
        self,
        *args: object,
        tensor: str | None = None,
        sender: int | None = None,
        receiver: int | None = None,
        failures: tuple[dict, ...] = (),
    ):
        super().__init__(*args)
        self.tensor = tensor
        self.sender = sender
        self.receiver = receiver
        self.failures = tuple(failures)

    def __reduce__(self):  # keep the keyword arguments across processes
        return (
            _rebuild_checksum_error,
            (type(self), self.args, self.tensor, self.sender, self.receiver, self.failures),
        )


def _rebuild_checksum_error(cls, args, tensor, sender, receiver, failures):
    return cls(*args, tensor=tensor, sender=sender, receiver=receiver, failures=failures)


class FormatVersionError(AnyshardError):
    """The checkpoint was written in a format version this anyshard cannot read."""


class MappingError(AnyshardError, ValueError):
    """A mapping expression is well formed but does not fit the tensor or the mesh."""


class UCLError(AnyshardError, ValueError):
    """A UCL text (spec or mapping) is wrong at a place: carries ``line``, ``column``, ``expected``
    and ``excerpt`` (the offending line with a caret under the column)."""

    def __init__(self, message: str, *, text: str, line: int, column: int, expected: str):
        self.text = text
        self.line = line
        self.column = column
        self.expected = expected
        self.reason = message
        lines = text.splitlines() or [""]
        src = lines[line - 1] if 0 < line <= len(lines) else ""
        caret = " " * max(column - 1, 0) + "^"
        self.excerpt = f"{src}\n{caret}"
        super().__init__(
            f"{message} at line {line}, column {column}; expected {expected}:\n  {src}\n  {caret}"
        )

    def __reduce__(self):  # keep the keyword-only constructor picklable across processes
        return (
            _rebuild_ucl_error,
            (type(self), self.reason, self.text, self.line, self.column, self.expected),
        )


def _rebuild_ucl_error(cls, message, text, line, column, expected):
    return cls(message, text=text, line=line, column=column, expected=expected)


class UCLSyntaxError(UCLError):
    """A UCL text does not follow the grammar."""


class UCLSemanticError(UCLError):
    """A UCL text parses but means nothing valid: an unknown name, a wrong argument, a layout
    that does not fit."""

    @classmethod
    def at(cls, node, message: str, *, text: str, expected: str) -> UCLSemanticError:
        """The error at a syntax node's position (line and column 1 where it has none)."""
        return cls(
            message,
            text=text,
            line=max(getattr(node, "line", 1), 1),
            column=max(getattr(node, "column", 1), 1),
            expected=expected,
        )


class MappingSyntaxError(MappingError, UCLSyntaxError):
    """A mapping expression could not be parsed; carries ``line``, ``column`` and an excerpt."""


class LayoutError(AnyshardError, ValueError):
    """A tensor's placement cannot be represented (e.g. a Partial placement)."""


class StateDictMismatchError(AnyshardError, KeyError):
    """The state dict to load does not match the checkpoint (keys, shapes or dtypes)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SaveError(AnyshardError):
    """A save failed on at least one rank; nothing was committed."""
