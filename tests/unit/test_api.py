"""Single-process save / load / open, checked against plain torch and the `safetensors` reader.

Run: python -m pytest tests/unit/test_api.py -q
"""

from __future__ import annotations

import collections
import doctest
import json
import os

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import anyshard
import anyshard.api.load
import anyshard.api.save
import anyshard.api.views
from anyshard.errors import (
    AnyshardError,
    CheckpointNotFoundError,
    SaveError,
    StateDictMismatchError,
)

DATA_FILE = os.path.join("data", "rank-00000.safetensors")


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's memory as safetensors stores it (C order), independent of anyshard."""
    if t.numel() == 0:
        return b""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert raw_bytes(got) == raw_bytes(want)


def zeros_like_state(state):
    """A destination with the same structure: zeroed tensors, placeholder JSON values."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(zeros_like_state(v) for v in state)
    return "placeholder"


def assert_same_state(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, torch.Tensor):
        assert_bit_exact(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_state(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same_state(g, w)
    else:
        assert got == want


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(5, 7, generator=g)
    f32[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return {
        "f32": f32,
        "bf16": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 2, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**62), 2**62, (6,), generator=g),
        "bool": torch.rand(3, 3, generator=g) > 0.5,
        "u8": torch.randint(0, 256, (2, 5), generator=g, dtype=torch.uint8),
    }


def training_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "model": {
            "embed.weight": torch.randn(10, 4, generator=g),
            "layers": {"0": {"wq": torch.randn(4, 4, generator=g).to(torch.bfloat16)}},
        },
        "optim": {
            "state": {
                "0": {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 4, generator=g)},
                "1": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 4, generator=g)},
            },
            "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "params": [0, 1], "name": None}],
        },
        "step": 3,
    }


def load_fresh(path: str, like: dict, **kwargs) -> dict:
    dest = zeros_like_state(like)
    anyshard.load(path, dest, **kwargs)
    return dest


@pytest.fixture
def ckpt(tmp_path) -> str:
    return str(tmp_path / "step-1")


# --- round trips -------------------------------------------------------------------------


def test_nested_model_and_optimizer_state_round_trips_bit_exact(ckpt):
    state = training_state()
    anyshard.save(ckpt, state)
    assert_same_state(load_fresh(ckpt, state), state)


@pytest.mark.parametrize("name", list(every_dtype()))
def test_each_supported_dtype_round_trips_bit_exact_including_nan_inf_and_negative_zero(
    tmp_path, name
):
    t = every_dtype()[name]
    anyshard.save(str(tmp_path / "c"), {"t": t})
    dest = {"t": torch.zeros_like(t)}
    anyshard.load(str(tmp_path / "c"), dest)
    assert_bit_exact(dest["t"], t)


def test_zero_dim_and_zero_size_tensors_round_trip(ckpt):
    state = {
        "scalar": torch.tensor(2.5),
        "int_scalar": torch.tensor(-7),
        "empty": torch.zeros(0, 3),
        "none": torch.ones(3, 0, 2),
    }
    anyshard.save(ckpt, state)
    assert_same_state(load_fresh(ckpt, state), state)
    with anyshard.open(ckpt) as view:
        assert view.metadata("empty").shape == (0, 3)
        assert_bit_exact(view.get_tensor("scalar"), state["scalar"])
        assert_bit_exact(view.get_tensor("empty"), state["empty"])


def test_non_contiguous_source_tensors_are_saved_as_their_logical_values(ckpt):
    base = torch.arange(48.0).reshape(6, 8)
    state = {
        "transposed": base.t(),
        "sliced": base[1:5, 2:7],
        "strided": base[::2, ::3],
        "expanded": torch.ones(3, 1).expand(3, 4),
    }
    anyshard.save(ckpt, state)
    dest = load_fresh(ckpt, state)
    for k, v in state.items():
        assert_bit_exact(dest[k], v.contiguous())


def test_load_fills_a_non_contiguous_destination_in_place_and_nothing_around_it(ckpt):
    w = torch.arange(24.0).reshape(4, 6)
    anyshard.save(ckpt, {"w": w, "v": w[:, :2]})
    transposed_storage = torch.zeros(6, 4)
    wide = torch.full((4, 5), -1.0)
    state = {"w": transposed_storage.t(), "v": wide[:, 1:3]}
    anyshard.load(ckpt, state)
    assert_bit_exact(transposed_storage.t().contiguous(), w)
    assert_bit_exact(wide[:, 1:3].contiguous(), w[:, :2].contiguous())
    assert (wide[:, 0] == -1).all() and (wide[:, 3:] == -1).all()


def test_load_casts_into_a_non_contiguous_destination_of_another_dtype(ckpt):
    w = torch.randn(5, 3)
    anyshard.save(ckpt, {"w": w})
    storage_ = torch.zeros(3, 5, dtype=torch.bfloat16)
    anyshard.load(ckpt, {"w": storage_.t()}, cast=True)
    assert_bit_exact(storage_.t().contiguous(), w.to(torch.bfloat16))


def test_tied_entries_save_under_both_names_and_load_into_tied_or_separate_tensors(ckpt):
    shared = torch.randn(4, 3)
    anyshard.save(ckpt, {"embed": shared, "lm_head": shared})
    with anyshard.open(ckpt) as view:
        assert sorted(view.keys()) == ["embed", "lm_head"]
    tied = torch.zeros(4, 3)
    anyshard.load(ckpt, {"embed": tied, "lm_head": tied})
    assert_bit_exact(tied, shared)
    separate = {"embed": torch.zeros(4, 3), "lm_head": torch.zeros(4, 3)}
    anyshard.load(ckpt, separate)
    assert_bit_exact(separate["embed"], shared)
    assert_bit_exact(separate["lm_head"], shared)


def test_lists_of_tensors_round_trip_by_index(ckpt):
    state = {"buffers": [torch.arange(3), torch.ones(2, 2), [torch.zeros(1), 5]]}
    anyshard.save(ckpt, state)
    with anyshard.open(ckpt) as view:
        assert sorted(view.keys()) == ["buffers.0", "buffers.1", "buffers.2.0"]
        assert view.get_value("buffers.2.1") == 5
    assert_same_state(load_fresh(ckpt, state), state)


def test_json_values_round_trip_and_replace_the_destination_values(ckpt):
    values = {
        "int": 2**62 + 1,
        "negative": -3,
        "float": 0.1,
        "tiny": 5e-324,
        "str": "héllo ✓",
        "none": None,
        "bool": True,
        "nested": {"a": [1, 2.5, {"b": None, "c": ["x"]}], "empty": {}, "list": []},
    }
    anyshard.save(ckpt, {"w": torch.ones(2), **values})
    dest = {"w": torch.zeros(2), **{k: "placeholder" for k in values}}
    anyshard.load(ckpt, dest)
    assert dest == {"w": dest["w"], **values}
    assert type(dest["bool"]) is bool and type(dest["int"]) is int
    with anyshard.open(ckpt) as view:
        assert sorted(view.value_keys()) == sorted(values)
        assert view.get_value("nested") == values["nested"]


Pair = collections.namedtuple("Pair", ["tensor", "count"])


def test_tuples_in_state_round_trip_and_keep_their_type(ckpt):
    state = {
        "betas": (0.9, 0.95),
        "mixed": (torch.arange(4.0), 7, "tag"),
        "nested": {"t": (torch.ones(2), (torch.zeros(3), 11))},
        "named": Pair(torch.full((2,), 3.0), 9),
    }
    anyshard.save(ckpt, state)
    dest = zeros_like_state(state)
    dest["named"] = Pair(torch.zeros(2), 0)
    filled = dest["mixed"][0]
    anyshard.load(ckpt, dest)
    assert_same_state(dest, state)
    assert dest["mixed"][0] is filled  # tensors are filled in place, not replaced


# --- lazy reads ----------------------------------------------------------------------------

FULL = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)

INDEXES = [
    0,
    -1,
    (1, 2, 3),
    (-1, -2, -3),
    slice(1, 3),
    (slice(None), slice(2, 4)),
    (Ellipsis, 1),
    (Ellipsis, slice(-2, None)),
    (1, Ellipsis),
    (1, Ellipsis, -1),
    (slice(3, 1),),
    (slice(-100, 100), slice(1, -1), slice(0, 0)),
    Ellipsis,
    (),
]


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("lazy") / "c")
    anyshard.save(path, {"full": FULL, "scalar": torch.tensor(4.5), "pad": torch.ones(100)})
    return path


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_get_slice_matches_plain_torch_indexing(full_ckpt, index):
    with anyshard.open(full_ckpt) as view:
        assert_bit_exact(view.get_slice("full")[index], FULL[index].contiguous())


def _index_strategy():
    def one(n):
        return st.one_of(
            st.integers(-n, n - 1),
            st.builds(
                slice,
                st.none() | st.integers(-n - 2, n + 2),
                st.none() | st.integers(-n - 2, n + 2),
            ),
        )

    dims = st.tuples(one(4), one(5), one(6))
    return st.tuples(dims, st.integers(0, 3), st.booleans()).map(_cut)


def _cut(args):
    dims, keep, ellipsis = args
    index = dims[:keep]
    return (Ellipsis, *index[1:]) if ellipsis and index else index


@settings(max_examples=60, deadline=None)
@given(index=_index_strategy())
def test_get_slice_matches_plain_torch_indexing_for_random_basic_indexes(full_ckpt, index):
    with anyshard.open(full_ckpt) as view:
        assert_bit_exact(view.get_slice("full")[index], FULL[index].contiguous())


def test_get_slice_of_a_zero_dim_tensor_matches_torch(full_ckpt):
    with anyshard.open(full_ckpt) as view:
        assert_bit_exact(view.get_slice("scalar")[...], torch.tensor(4.5)[...])
        assert_bit_exact(view.get_slice("scalar")[()], torch.tensor(4.5)[()])


def test_get_slice_rejects_out_of_range_indices_like_torch(full_ckpt):
    with anyshard.open(full_ckpt) as view, pytest.raises(IndexError, match="full"):
        view.get_slice("full")[4]


class CountingReads:
    """Wraps ``os.preadv``, which every read of a local data file goes through (the real reads
    still happen), to total the bytes read."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        real = os.preadv

        def preadv(fd, buffers, offset, *args):
            got = real(fd, buffers, offset, *args)
            self.calls.append((offset, got))
            return got

        monkeypatch.setattr(os, "preadv", preadv)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.calls)


def test_get_slice_reads_only_the_rows_it_needs_when_unverified(full_ckpt, monkeypatch):
    with anyshard.open(full_ckpt, verify=False) as view:
        view.get_tensor("pad")  # reads and caches the file header
        reads = CountingReads(monkeypatch)
        got = view.get_slice("full")[1:3]
    assert_bit_exact(got, FULL[1:3].contiguous())
    assert reads.total == 2 * 5 * 6 * 4
    assert reads.total < FULL.numel() * 4


def test_get_slice_of_one_element_reads_four_bytes_when_unverified(full_ckpt, monkeypatch):
    with anyshard.open(full_ckpt, verify=False) as view:
        view.get_tensor("pad")
        reads = CountingReads(monkeypatch)
        assert view.get_slice("full")[2, 3, 4].item() == FULL[2, 3, 4].item()
    assert reads.calls and reads.total == 4


def test_a_verified_slice_reads_the_whole_checksum_blocks_or_tiles_it_touches(
    tmp_path, monkeypatch
):
    narrow = torch.arange(1024 * 256, dtype=torch.float32).reshape(1024, 256)  # 1 KiB rows
    wide = torch.arange(256 * 4096, dtype=torch.float32).reshape(256, 4096)  # 16 KiB rows
    path = str(tmp_path / "big")
    anyshard.save(path, {"narrow": narrow, "wide": wide})
    with anyshard.open(path) as view:
        view.get_slice("narrow")[0]  # reads the data file's header
        shards = next(iter(view._headers.values())).shards
        n, w = shards["narrow"], shards["wide"]
        assert n.block == 128 * 1024  # 128 rows: a power of two that divides an eighth
        assert n.tiles == 1  # rows under 8 KiB: no tiles
        assert w.block == 256 * 1024 and w.tiles == 16  # 16 rows; column blocks of 1 KiB
        reads = CountingReads(monkeypatch)
        # a narrow row has no tiles (a slice of it would skip less than a page): the block
        assert_bit_exact(view.get_slice("narrow")[130:140, 5:9], narrow[130:140, 5:9].clone())
        assert reads.total == n.block
        reads.calls.clear()
        # a wide row's: rows 128..143 x columns 0..255, one tile, not the block's whole rows
        assert_bit_exact(view.get_slice("wide")[130:140, 5:9], wide[130:140, 5:9].clone())
        assert reads.total == w.block // 16
        reads.calls.clear()
        assert_bit_exact(view.get_slice("wide")[130:140, 200:300], wide[130:140, 200:300].clone())
        assert reads.total == w.block // 8  # two tiles of the block
        reads.calls.clear()
        assert_bit_exact(view.get_slice("narrow")[256:512], narrow[256:512].contiguous())
        assert reads.total == 256 * 1024  # aligned rows: exactly what is needed


def test_metadata_describes_shape_dtype_and_the_one_stored_shard(full_ckpt):
    with anyshard.open(full_ckpt) as view:
        meta = view.metadata("full")
        slice_ = view.get_slice("full")
        assert slice_.get_shape() == [4, 5, 6] and slice_.get_dtype() == "F32"
    assert meta.shape == (4, 5, 6) and meta.dtype == torch.float32
    assert meta.nbytes == FULL.numel() * 4
    assert [(s.rank, s.file, s.regions) for s in meta.shards] == [
        (0, "data/rank-00000.safetensors", (((0, 4), (0, 5), (0, 6)),))
    ]


def test_open_names_missing_tensors_and_values_in_key_errors(full_ckpt):
    with anyshard.open(full_ckpt) as view:
        with pytest.raises(KeyError, match="nope"):
            view.get_tensor("nope")
        with pytest.raises(KeyError, match="nope"):
            view.get_value("nope")


# --- the files are plain safetensors ------------------------------------------------------


def test_data_file_opens_with_safetensors_and_holds_the_same_tensors_and_checksums(ckpt):
    state = {
        **every_dtype(),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "t": torch.arange(6.0).reshape(2, 3).t(),
    }
    anyshard.save(ckpt, state)
    assert sorted(os.listdir(ckpt)) == ["data", "manifest.json"]
    with safe_open(os.path.join(ckpt, DATA_FILE), framework="pt") as f:
        assert sorted(f.keys()) == sorted(state)
        meta = json.loads(f.metadata()["anyshard"])
        for name, want in state.items():
            got = f.get_tensor(name)
            assert_bit_exact(got, want.contiguous())
            raw = raw_bytes(want)
            block = meta["blocks"][name]["bytes"]
            crcs = [crc32c.crc32c(raw[a : a + block]) for a in range(0, len(raw), block)] or [0]
            assert meta["blocks"][name]["crc32c"] == crcs


# --- strictness, shapes and dtypes --------------------------------------------------------


def test_strict_false_ignores_missing_and_unexpected_keys(ckpt):
    anyshard.save(ckpt, {"a": torch.ones(2), "b": torch.ones(3), "n": 1})
    dest = {"a": torch.zeros(2), "extra": torch.zeros(4), "extra_value": "kept"}
    anyshard.load(ckpt, dest, strict=False)
    assert_bit_exact(dest["a"], torch.ones(2))
    assert_bit_exact(dest["extra"], torch.zeros(4))
    assert dest["extra_value"] == "kept"


def test_strict_load_reports_missing_and_unexpected_keys_together_sorted_and_reads_nothing(ckpt):
    anyshard.save(
        ckpt,
        {
            "z_stored": torch.ones(2),
            "a_stored": torch.ones(2),
            "shared": torch.ones(2),
            "v_stored": 3,
        },
    )
    dest = {"shared": torch.zeros(2), "y_new": torch.zeros(1), "b_new": 0}
    with pytest.raises(StateDictMismatchError) as info:
        anyshard.load(ckpt, dest)
    message = str(info.value)
    assert ckpt in message
    assert "missing from the checkpoint (2): b_new, y_new" in message
    assert (
        "in the checkpoint but not in the state dict (3): a_stored, v_stored, z_stored" in message
    )
    assert_bit_exact(dest["shared"], torch.zeros(2))


def test_shape_mismatch_names_the_tensor_and_both_shapes(ckpt):
    anyshard.save(ckpt, {"layers.0.w": torch.ones(4, 6)})
    with pytest.raises(
        StateDictMismatchError,
        match=r"layers\.0\.w: global shape \[4, 5\] in the state dict, \[4, 6\] in the checkpoint",
    ):
        anyshard.load(ckpt, {"layers.0.w": torch.zeros(4, 5)})


def test_dtype_mismatch_is_an_error_unless_cast_is_passed(ckpt):
    w = torch.randn(3, 4)
    anyshard.save(ckpt, {"w": w})
    dest = {"w": torch.zeros(3, 4, dtype=torch.bfloat16)}
    with pytest.raises(
        StateDictMismatchError,
        match=r"w: dtype torch\.bfloat16 in the state dict, torch\.float32 in the checkpoint.*cast=True",
    ):
        anyshard.load(ckpt, dest)
    anyshard.load(ckpt, dest, cast=True)
    assert_bit_exact(dest["w"], w.to(torch.bfloat16))


def test_tensor_stored_as_json_value_or_the_reverse_is_a_mismatch(ckpt):
    anyshard.save(ckpt, {"t": torch.ones(2), "v": 1})
    with pytest.raises(StateDictMismatchError) as info:
        anyshard.load(ckpt, {"t": 0, "v": torch.zeros(1)})
    assert "t: the checkpoint holds a tensor" in str(info.value)
    assert "v: the checkpoint holds a JSON value" in str(info.value)


# --- save refusals ------------------------------------------------------------------------


class Custom:
    pass


@pytest.mark.parametrize("bad", [{1, 2}, Custom(), b"bytes"], ids=["set", "custom-class", "bytes"])
def test_saving_a_non_json_value_names_the_key_and_commits_nothing(ckpt, bad):
    with pytest.raises(AnyshardError, match=r"optim\.extra: .*cannot be stored.*never pickles"):
        anyshard.save(ckpt, {"w": torch.ones(2), "optim": {"extra": bad, "m": torch.ones(1)}})
    with pytest.raises(CheckpointNotFoundError):
        anyshard.open(ckpt)
    anyshard.save(ckpt, {"w": torch.ones(2)})  # the path is still free for a good save


def test_saving_a_tensor_of_an_unstorable_dtype_names_the_key(ckpt):
    with pytest.raises(AnyshardError, match=r"model\.c: dtype torch\.complex128"):
        anyshard.save(ckpt, {"model": {"c": torch.zeros(2, dtype=torch.complex128)}})


def test_saving_twice_to_one_path_raises_and_leaves_the_first_checkpoint_intact(ckpt):
    first = {"w": torch.arange(5.0), "step": 1}
    anyshard.save(ckpt, first)
    before = {
        name: open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(ckpt)
        for name in names
    }
    with pytest.raises(SaveError, match="already holds a committed checkpoint"):
        anyshard.save(ckpt, {"w": torch.zeros(5), "step": 2})
    after = {
        name: open(os.path.join(root, name), "rb").read()
        for root, _, names in os.walk(ckpt)
        for name in names
    }
    assert after == before
    assert_same_state(load_fresh(ckpt, first), first)


# --- documentation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [anyshard.api.save, anyshard.api.load, anyshard.api.views], ids=lambda m: m.__name__
)
def test_public_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0
