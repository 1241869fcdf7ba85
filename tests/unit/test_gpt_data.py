"""The reference trainer's data: byte tokenizer, shipped corpus, and a loader that resumes exactly
under another data-parallel degree."""

import doctest
import json
import re

import pytest
import torch

from anyshard.trainer_integration.gpt import data as data_module
from anyshard.trainer_integration.gpt.data import ByteTokenizer, DataLoader, load_corpus

SEQ = 4
# Distinct token values: a sample's first token is its start, so samples can be told apart.
# 5 windows of SEQ + 1 tokens: a global batch of 4 wraps an epoch at every step but the 5th.
TINY = torch.arange(5 * SEQ + 1)


def _loader(dp_rank=0, dp_size=1, *, tokens=TINY, seq_len=SEQ, global_batch=4, seed=0):
    return DataLoader(
        tokens,
        seq_len=seq_len,
        global_batch=global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )


def _step(loaders) -> torch.Tensor:
    """One step on every rank; the ranks' samples (inputs and the last target) in rank order."""
    rows = []
    for loader in loaders:
        inputs, targets = loader.next_batch()
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        rows.append(torch.cat([inputs, targets[:, -1:]], dim=1))
    return torch.cat(rows)


def test_the_byte_tokenizer_round_trips_utf8_text():
    tok = ByteTokenizer()
    text = "Alice said: «curiouser» — 好奇 🐇\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_the_byte_tokenizer_decodes_invalid_bytes_and_large_ids_as_replacement_characters():
    assert ByteTokenizer().decode([0x41, 0xC3, 0x42, 256, -1]) == "A\ufffdB\ufffd\ufffd"


def test_the_shipped_corpus_is_byte_tokens_of_a_named_public_domain_work():
    tokens = load_corpus()
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert 40_000 <= tokens.numel() <= 80_000
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256
    text = bytes(tokens.tolist()).decode("utf-8")  # valid UTF-8
    first_line = text.splitlines()[0]
    assert "Alice's Adventures in Wonderland" in first_line and "Lewis Carroll" in first_line
    assert "Gutenberg" not in text


def test_the_same_seed_gives_the_same_batches_and_another_seed_another_order():
    corpus = load_corpus()
    a, b = (
        _loader(tokens=corpus, seq_len=32, global_batch=8),
        _loader(tokens=corpus, seq_len=32, global_batch=8),
    )
    c = _loader(tokens=corpus, seq_len=32, global_batch=8, seed=1)
    for _ in range(3):
        batch_a, batch_b, batch_c = a.next_batch(), b.next_batch(), c.next_batch()
        assert all(torch.equal(x, y) for x, y in zip(batch_a, batch_b, strict=True))
        assert not torch.equal(batch_a[0], batch_c[0])
        assert batch_a[0].shape == batch_a[1].shape == (8, 32) and batch_a[0].dtype == torch.int64


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_the_ranks_local_batches_in_rank_order_are_the_global_batch(dp_size):
    corpus = load_corpus()
    loaders = [
        _loader(r, dp_size, tokens=corpus, seq_len=32, global_batch=8) for r in range(dp_size)
    ]
    reference = _loader(tokens=corpus, seq_len=32, global_batch=8)
    for step in range(4):
        assert torch.equal(_step(loaders), reference.peek_global_batch(step))
    assert loaders[0].local_batch == 8 // dp_size


def test_every_epoch_visits_each_window_once_in_a_new_order():
    loader = _loader()
    starts = loader.sample_starts(0, 3 * loader.num_windows)
    epochs = [starts[i : i + 5] for i in range(0, 15, 5)]
    assert all(sorted(epoch) == [0, 4, 8, 12, 16] for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1
    assert [int(row[0]) for row in loader.peek_global_batch(1)] == starts[4:8]


def _ids(rows: torch.Tensor) -> list[int]:
    return [int(row[0]) for row in rows]  # with TINY a sample's first token is its start


@pytest.mark.parametrize("saved_at", [1, 2, 3])
def test_a_state_saved_at_dp4_resumes_at_dp2_with_exactly_the_next_global_samples(saved_at):
    total = 6  # 24 samples: over the boundaries of epochs 0 to 4 of 5 windows
    uninterrupted = _loader()
    expected = [_ids(_step([uninterrupted])) for _ in range(total)]

    first = [_loader(r, 4, global_batch=4) for r in range(4)]
    got = [_ids(_step(first)) for _ in range(saved_at)]
    states = [loader.state_dict() for loader in first]
    assert all(state == states[0] for state in states)  # the same on every rank
    state = json.loads(json.dumps(states[0]))

    resumed = [_loader(r, 2) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    got += [_ids(_step(resumed)) for _ in range(total - saved_at)]
    assert got == expected
    flat = [i for ids in got for i in ids]  # no sample skipped or repeated within an epoch
    assert all(sorted(flat[e : e + 5]) == [0, 4, 8, 12, 16] for e in range(0, 20, 5))


def test_the_state_dict_holds_json_values_only_and_survives_a_json_round_trip():
    loader = _loader(1, 2)
    loader.next_batch()
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "samples_consumed": 4,
        "seed": 0,
        "global_batch": 4,
        "seq_len": SEQ,
        "num_windows": 5,
    }


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"seed": 1}, "seed (saved 0, now 1)"),
        ({"seq_len": 2}, "seq_len (saved 4, now 2)"),
        ({"global_batch": 8}, "global_batch (saved 4, now 8)"),
        ({"tokens": torch.arange(50)}, "num_windows (saved 5, now 12)"),
    ],
)
def test_loading_a_state_of_another_order_raises_naming_what_differs(kwargs, named):
    saved = _loader()
    saved.next_batch()
    with pytest.raises(
        ValueError,
        match="differs from this loader's in .*" + re.escape(named),
    ):
        _loader(**kwargs).load_state_dict(saved.state_dict())


def test_loading_a_malformed_state_raises():
    state = _loader().state_dict()
    with pytest.raises(ValueError, match="lacks samples_consumed"):
        _loader().load_state_dict({k: v for k, v in state.items() if k != "samples_consumed"})
    with pytest.raises(ValueError, match="samples_consumed must be an int >= 0, got -4"):
        _loader().load_state_dict(state | {"samples_consumed": -4})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"global_batch": 6, "dp_size": 4},
            "global_batch \\(6\\) is not divisible by dp_size \\(4\\)",
        ),
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank \\(2\\) must be in \\[0, dp_size = 2\\)"),
        (
            {"tokens": torch.arange(4)},
            "the corpus of 4 tokens holds no window of seq_len \\+ 1 = 5",
        ),
        ({"tokens": torch.zeros(2, 9, dtype=torch.int64)}, "tokens must be a 1-d integer tensor"),
        ({"seq_len": 0}, "must be >= 1"),
    ],
)
def test_a_loader_that_cannot_work_is_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _loader(**kwargs)


def test_the_docstring_examples_run():
    result = doctest.testmod(data_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
