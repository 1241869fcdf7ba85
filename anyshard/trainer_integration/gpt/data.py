"""The data of the reference GPT trainer: a byte tokenizer, the shipped corpus, a resumable loader.

The loader's order is a pure function of the seed and the global sample index, and step ``k``
takes the global samples ``[k * global_batch, (k + 1) * global_batch)``, each data-parallel rank
a contiguous slice of them. Its position is therefore one number that does not depend on the
data-parallel degree: a run saved at dp=4 resumes at dp=2 with exactly the next samples.

Run the examples: ``python -m pytest --doctest-modules anyshard/trainer_integration/gpt/data.py``
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["ByteTokenizer", "DataLoader", "load_corpus"]


class ByteTokenizer:
    """Text as its UTF-8 bytes: ids 0 to 255, no training, no vocabulary file.

    >>> tok = ByteTokenizer()
    >>> tok.encode("héllo")
    [104, 195, 169, 108, 108, 111]
    >>> tok.decode([104, 195, 169, 108, 108, 111])
    'héllo'
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8, and ids above 255 (which a model
        with a larger vocabulary may sample), become U+FFFD.

        >>> ByteTokenizer().decode([104, 105, 300, 0xC3])
        'hi\ufffd\ufffd'
        """
        # 0xFF never occurs in UTF-8, so it decodes to U+FFFD like any other invalid byte
        data = bytes(i if 0 <= i < 256 else 0xFF for i in map(int, ids))
        return data.decode("utf-8", errors="replace")


def load_corpus() -> torch.Tensor:
    """The shipped corpus (the first chapters of Alice's Adventures in Wonderland) as int64
    byte tokens; read from the installed package, nothing is downloaded.

    >>> tokens = load_corpus()
    >>> tokens.dtype, ByteTokenizer().decode(tokens[:32].tolist())
    (torch.int64, "Alice's Adventures in Wonderland")
    """
    data = (
        importlib.resources.files("anyshard.trainer_integration.gpt")
        .joinpath("corpus.txt")
        .read_bytes()
    )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class DataLoader:
    """Batches of token windows in a seeded order, resumable under another data-parallel degree.

    The corpus is cut into ``num_windows`` non-overlapping windows of ``seq_len + 1`` tokens
    (starts ``0, seq_len, 2 * seq_len, ...``). Global sample ``i`` lies in epoch
    ``e = i // num_windows``, whose order is ``torch.randperm(num_windows)`` seeded by
    ``seed + e``, and takes position ``i % num_windows`` of it. Optimizer step ``k`` consumes
    global samples ``[k * global_batch, (k + 1) * global_batch)``; rank ``dp_rank`` of ``dp_size``
    takes the contiguous slice of ``global_batch // dp_size`` of them.

    >>> loader = DataLoader(torch.arange(100), seq_len=4, global_batch=4, dp_rank=1, dp_size=2,
    ...                     seed=0)
    >>> inputs, targets = loader.next_batch()
    >>> inputs.shape, bool((inputs[:, 1:] == targets[:, :-1]).all())
    (torch.Size([2, 4]), True)
    >>> loader.state_dict()
    {'samples_consumed': 4, 'seed': 0, 'global_batch': 4, 'seq_len': 4, 'num_windows': 24}
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(
                f"tokens must be a 1-d integer tensor, got {tokens.dtype} of shape "
                f"{tuple(tokens.shape)}; flatten it and convert it with .long()"
            )
        if seq_len < 1 or global_batch < 1 or dp_size < 1:
            raise ValueError(
                f"seq_len ({seq_len}), global_batch ({global_batch}) and dp_size ({dp_size}) "
                f"must be >= 1"
            )
        if global_batch % dp_size:
            raise ValueError(
                f"global_batch ({global_batch}) is not divisible by dp_size ({dp_size}); "
                f"set global_batch to a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank ({dp_rank}) must be in [0, dp_size = {dp_size})")
        self.num_windows = (tokens.numel() - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the corpus of {tokens.numel()} tokens holds no window of seq_len + 1 = "
                f"{seq_len + 1} tokens; use a shorter seq_len or a longer corpus"
            )
        self.tokens = tokens.to(torch.int64).contiguous()
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.samples_consumed = 0  # global samples consumed by all ranks together
        # uneven data shares (the layout scheduler's, for a slow data rank): samples of each
        # data rank in rank order, adding up to global_batch; None splits evenly
        self.shares: tuple[int, ...] | None = None
        self._orders: dict[int, list[int]] = {}  # window order per epoch, the last few only

    @property
    def local_batch(self) -> int:
        """Sequences per step on this rank: ``global_batch // dp_size``, or its share."""
        if self.shares is not None:
            return self.shares[self.dp_rank]
        return self.global_batch // self.dp_size

    def set_shares(self, shares: tuple[int, ...] | None) -> None:
        """Give each data rank its own number of samples of every global batch (``None``: even
        shares); the order of the samples and the global batch stay the same.

        >>> loader = DataLoader(torch.arange(100), seq_len=4, global_batch=4, dp_rank=1,
        ...                     dp_size=2, seed=0)
        >>> whole = loader.peek_global_batch(0)[:, :-1]
        >>> loader.set_shares((1, 3))
        >>> bool((loader.next_batch()[0] == whole[1:]).all())
        True
        """
        if shares is not None and (
            len(shares) != self.dp_size or sum(shares) != self.global_batch or min(shares) < 1
        ):
            raise ValueError(
                f"shares {shares} must give each of {self.dp_size} data ranks at least one "
                f"sample and add up to the global batch of {self.global_batch}"
            )
        self.shares = None if shares is None else tuple(shares)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(self.num_windows, generator=generator).tolist()
        return self._orders[epoch]

    def sample_starts(self, first: int, count: int) -> list[int]:
        """The token offsets where global samples ``first, ..., first + count - 1`` start.

        >>> DataLoader(torch.arange(9), seq_len=2, global_batch=1, dp_rank=0, dp_size=1,
        ...            seed=0).sample_starts(0, 8)  # two epochs of the 4 windows
        [0, 2, 6, 4, 2, 6, 4, 0]
        """
        n = self.num_windows
        return [self._order(i // n)[i % n] * self.seq_len for i in range(first, first + count)]

    def _samples(self, first: int, count: int) -> torch.Tensor:
        starts = torch.tensor(self.sample_starts(first, count), dtype=torch.int64)
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the next step, int64 ``[local_batch, seq_len]``
        each, targets being inputs shifted by one token; advances the position by one step."""
        if self.shares is not None:
            first = self.samples_consumed + sum(self.shares[: self.dp_rank])
            rows = self._samples(first, self.shares[self.dp_rank])
            batch = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        else:
            batch = self.batch_at(self.samples_consumed, self.dp_rank, self.dp_size)
        self.samples_consumed += self.global_batch
        return batch

    def batch_at(
        self, position: int, dp_rank: int, dp_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``dp_rank`` of ``dp_size``'s (inputs, targets) of the step whose global batch
        starts at sample ``position``; the position does not move. A fault-tolerant replica
        group trains a lost group's share of a step with it.

        >>> loader = DataLoader(torch.arange(100), seq_len=4, global_batch=4, dp_rank=0, dp_size=2,
        ...                     seed=0)
        >>> loader.batch_at(0, 1, 4)[0].tolist() == loader.next_batch()[0][1:].tolist()
        True
        """
        if self.global_batch % dp_size or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"rank {dp_rank} of dp_size {dp_size} has no share of a global batch of "
                f"{self.global_batch}: dp_size must divide it and dp_rank lie in [0, dp_size)"
            )
        local = self.global_batch // dp_size
        rows = self._samples(position + dp_rank * local, local)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def peek_global_batch(self, step: int) -> torch.Tensor:
        """All samples of step ``step`` (counting from 0), ``[global_batch, seq_len + 1]``,
        whatever the position; for tests and single-process reference runs."""
        return self._samples(step * self.global_batch, self.global_batch)

    def state_dict(self) -> dict[str, Any]:
        """The position and what it depends on, JSON values only, the same on every rank."""
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "num_windows": self.num_windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at the saved position; ValueError if the order would differ from the saved
        run's (another seed, seq_len, global_batch or corpus), naming what differs."""
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"data loader state lacks {', '.join(missing)}; got {dict(state)}")
        differ = [
            f"{key} (saved {state[key]!r}, now {mine[key]!r})"
            for key in ("seed", "seq_len", "global_batch", "num_windows")
            if state[key] != mine[key]
        ]
        if differ:
            raise ValueError(
                f"the saved data order differs from this loader's in {', '.join(differ)}; "
                f"resume with the saved run's values (num_windows: the same corpus and seq_len)"
            )
        consumed = state["samples_consumed"]
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise ValueError(f"samples_consumed must be an int >= 0, got {consumed!r}")
        self.samples_consumed = consumed
