"""`anyshard.format.transit`: the crc32c of tensors as sent, the check on arrival, the error
every rank raises, and `ChecksumError`'s fields (kept across processes, optional as before)."""

from __future__ import annotations

import pickle

import crc32c
import pytest
import torch

from anyshard.api.redistribute import _Side
from anyshard.api.transfer import _arrived, _incoming, _outgoing, _Staging
from anyshard.errors import ChecksumError, CorruptCheckpointError
from anyshard.format import transit
from anyshard.reshard.exchange import Move, Round


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_crc_of_is_the_crc32c_of_the_bytes_in_c_order(dtype):
    t = (torch.arange(60) * 37 % 251).to(dtype).reshape(6, 10)
    want = crc32c.crc32c(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert transit.crc_of(t) == want
    col = t[:, 2:5]  # strided: its elements in C order
    assert transit.crc_of(col) == crc32c.crc32c(
        col.contiguous().view(torch.uint8).numpy().tobytes()
    )
    assert transit.crc_of(t[:0]) == 0


def test_check_finds_one_flipped_bit_and_skips_unchecked():
    t = torch.arange(100, dtype=torch.float32)
    sent = transit.crc_of(t)
    assert transit.check(sent, t, "w", ((0, 100),), 1, 0) is None
    bad = t.clone()
    bad.view(torch.uint8)[123] ^= 0x10
    m = transit.check(sent, bad, "w", ((0, 100),), 1, 0)
    assert m is not None and (m.tensor, m.sender, m.receiver, m.sent) == ("w", 1, 0, sent)
    assert m.got == transit.crc_of(bad) != sent
    assert transit.check(transit.UNCHECKED, bad, "w", ((0, 100),), 1, 0) is None


def test_transit_error_names_the_first_failure_and_counts_the_rest():
    a = transit.Mismatch("layers.1.w", ((0, 4), (2, 6)), 3, 1, 0x1234, 0xABCD).to_json()
    b = transit.Mismatch("layers.0.w", ((0, 4),), 2, 0, 0x1, 0x2).to_json()
    e = transit.transit_error([a, b], "redistribute")
    assert isinstance(e, ChecksumError) and isinstance(e, CorruptCheckpointError)
    assert (e.tensor, e.sender, e.receiver) == ("layers.0.w", 2, 0)  # the lowest receiver
    assert len(e.failures) == 2
    text = str(e)
    assert "layers.0.w [0:4] sent by rank 2 arrived at rank 0" in text
    assert "00000002" in text and "00000001" in text and "2 pieces in all" in text


def test_checksum_error_fields_are_optional_and_survive_pickling():
    plain = ChecksumError("a stored shard")
    assert (plain.tensor, plain.sender, plain.receiver, plain.failures) == (None, None, None, ())
    assert str(plain) == "a stored shard"
    e = transit.transit_error(
        [transit.Mismatch("w", ((0, 2),), 1, 0, 5, 6).to_json()], "load of /ckpt"
    )
    back = pickle.loads(pickle.dumps(e))  # noqa: S301 - as multiprocessing passes an error
    assert type(back) is ChecksumError and str(back) == str(e)
    assert (back.tensor, back.sender, back.receiver, back.failures) == ("w", 1, 0, e.failures)


def test_enabled_by_default_and_turned_off_by_env_or_argument(monkeypatch):
    monkeypatch.delenv(transit.ENV, raising=False)
    assert transit.enabled() and not transit.enabled(False)
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv(transit.ENV, off)
        assert not transit.enabled() and transit.enabled(True)
    monkeypatch.setenv(transit.ENV, "1")
    assert transit.enabled()


def _sides(shape):
    from anyshard.api.transfer import Held as _Held
    from anyshard.geometry.boxes import Piece, full_box

    src, dst = _Side(), _Side()
    box = full_box(shape)
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    src.held["w"] = [_Held(full, Piece(0, shape, box, box))]
    out = torch.zeros(shape)
    dst.held["w"] = [_Held(out, Piece(0, shape, box, box))]
    return full, src, dst, out


@pytest.mark.parametrize("rows", [4, 800])  # packed with others; sent and received in place
def test_a_message_sent_and_received_in_one_process(rows):
    """What `_outgoing` sends, received as `_incoming` lays it out: the crc32c computed while
    packing match on arrival; one flipped bit is found in the move that holds it."""
    shape = (rows, 256)
    full, src, dst, out = _sides(shape)
    moves = [
        Move(0, 1, "w", ((0, rows // 2), (0, 256)), rows // 2 * 256 * 4),
        Move(0, 1, "w", ((rows // 2, rows), (0, 256)), rows // 2 * 256 * 4),
    ]
    rnd = Round(send=[(1, moves)], recv=[(0, moves)])
    for flip in (False, True):
        out.zero_()
        stage = _Staging([rnd], torch.device("cpu"), False)
        sent, crcs = _outgoing(moves, src, stage, checked=True)
        parts = _incoming(moves, dst, stage)
        assert len(sent) == len(parts)
        for s, (t, _, _) in zip(sent, parts, strict=True):
            t.copy_(s)  # the wire
        if flip:
            parts[-1][0].view(torch.uint8)[-1] ^= 0x80
        failed: list = []
        _arrived(parts, crcs, 0, 1, dst, failed)
        if not flip:
            assert failed == [] and torch.equal(out, full)
        else:
            assert [(m.tensor, m.box, m.sender, m.receiver) for m in failed] == [
                ("w", moves[1].box, 0, 1)
            ]


def test_agreement_in_one_process_raises_what_it_found():
    from anyshard.api.transfer import agree_on_transit

    agree_on_transit([], None, "redistribute")  # nothing found: returns
    m = transit.Mismatch("w", ((0, 2),), 1, 0, 5, 6)
    with pytest.raises(ChecksumError) as raised:
        agree_on_transit([m], None, "redistribute")
    assert (raised.value.tensor, raised.value.sender, raised.value.receiver) == ("w", 1, 0)
