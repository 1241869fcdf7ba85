"""The reference trainer's configuration: defaults, TOML file, overrides, validation, round trip."""

import copy
import dataclasses
import doctest
import importlib.resources
import re

import pytest

from anyshard.trainer_integration.gpt import config as config_module
from anyshard.trainer_integration.gpt.config import (
    FAULT_ENV,
    TINY_CONFIG,
    CheckpointConfig,
    Config,
    ConfigError,
    FaultConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    config_to_dict,
    dump_toml,
    load_config,
    loads_config,
    parse_fault_env,
    validate,
)


@pytest.fixture(autouse=True)
def _no_fault_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)


def _default_toml() -> str:
    files = importlib.resources.files("anyshard.trainer_integration.gpt")
    return files.joinpath("default.toml").read_text(encoding="utf-8")


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_defaults_validate_and_default_toml_writes_them_all_out():
    validate(Config())
    assert load_config() == Config()
    text = _default_toml()
    assert loads_config(text) == Config()
    for section, values in config_to_dict(Config()).items():
        keys = values if isinstance(values, dict) else {section: values}
        for key in keys:  # None values are there too, commented out
            assert f"\n{key} = " in text or f"\n# {key} = " in text, key


def test_world_size_is_the_product_and_dims_follow_the_mesh_order():
    par = ParallelConfig(pp=2, dp_replicate=3, dp_shard=5, ep=7, cp=11, tp=13)
    assert par.world_size == 2 * 3 * 5 * 7 * 11 * 13
    assert par.dp_size == 3 * 5 * 7
    assert par.dims() == (
        ("pp", 2),
        ("dp_replicate", 3),
        ("dp_shard", 5),
        ("ep", 7),
        ("cp", 11),
        ("tp", 13),
    )


def test_overrides_beat_the_toml_file_which_beats_the_defaults(tmp_path):
    path = _write(
        tmp_path,
        'run_dir = "runs/x"\n[train]\nsteps = 10\nlr = 1e-3\n[parallel]\ndp_shard = 2\n',
    )
    cfg = load_config(path, ["--train.steps", "12", "--run_dir=runs/y"])
    assert cfg.train.steps == 12  # override
    assert cfg.train.lr == 1e-3 and cfg.parallel.dp_shard == 2  # file
    assert cfg.train.seq_len == TrainConfig().seq_len and cfg.model == ModelConfig()  # defaults
    assert cfg.run_dir == "runs/y"


@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallel.tp", "2", "--train.lr", "3e-4", "--checkpoint.root", "s3://b/ckpt"],
        ["--parallel.tp=2", "--train.lr=3e-4", "--checkpoint.root=s3://b/ckpt"],
        ["--parallel.tp=2", "--train.lr", "3e-4", "--checkpoint.root=s3://b/ckpt"],
    ],
)
def test_both_override_syntaxes_give_the_same_config(overrides):
    cfg = load_config(TINY_CONFIG, overrides)
    assert (cfg.parallel.tp, cfg.train.lr, cfg.checkpoint.root) == (2, 3e-4, "s3://b/ckpt")


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("TRUE", True), ("1", True), ("yes", True)]
    + [("false", False), ("0", False), ("no", False)],
)
def test_bool_overrides_accept_true_false_1_0_yes_no(text, value):
    assert load_config(TINY_CONFIG, ["--checkpoint.async_", text]).checkpoint.async_ is value
    assert (
        load_config(TINY_CONFIG, [f"--model.tie_embeddings={text}"]).model.tie_embeddings is value
    )


def test_a_bare_bool_flag_means_true_and_the_last_override_wins():
    cfg = load_config(TINY_CONFIG, ["--checkpoint.async_", "--train.steps", "3", "--train.steps=4"])
    assert cfg.checkpoint.async_ is True and cfg.train.steps == 4


def test_none_and_null_clear_an_optional_field(tmp_path):
    path = _write(tmp_path, '[checkpoint]\nlocal_dir = "/tmp/l"\n')
    assert load_config(path).checkpoint.local_dir == "/tmp/l"
    assert load_config(path, ["--checkpoint.local_dir", "none"]).checkpoint.local_dir is None
    assert load_config(path, ["--checkpoint.local_dir=null"]).checkpoint.local_dir is None
    cfg = load_config(TINY_CONFIG, ["--fault.kill_rank", "0", "--fault.kill_step=3"])
    assert (cfg.fault.kill_rank, cfg.fault.kill_step) == (0, 3)


def test_an_int_in_toml_is_accepted_for_a_float_field(tmp_path):
    cfg = load_config(_write(tmp_path, "[train]\ngrad_clip = 2\n"))
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--train.steps", "ten"], "--train.steps ten: expected int, got 'ten' (str)"),
        (["--train.steps=none"], "--train.steps none: expected int, got 'none'"),
        (["--train.lr", "fast"], "--train.lr fast: expected float, got 'fast'"),
        (
            ["--checkpoint.async_", "maybe"],
            "--checkpoint.async_ maybe: expected bool (true or false), got 'maybe'",
        ),
        (["--fault.kill_rank", "x"], "--fault.kill_rank x: expected int or none, got 'x'"),
        (["--train.steps"], "--train.steps: missing value; expected int"),
    ],
)
def test_a_wrong_type_on_the_command_line_names_the_key_the_value_and_the_type(overrides, expected):
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        load_config(TINY_CONFIG, overrides)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[train]\nsteps = "3"\n', "[train] steps: expected int, got '3' (str)"),
        ("[train]\nsteps = 2.5\n", "[train] steps: expected int, got 2.5 (float)"),
        ("[train]\nsteps = true\n", "[train] steps: expected int, got True (bool)"),
        ("[checkpoint]\nasync_ = 1\n", "[checkpoint] async_: expected bool (true or false)"),
        ('[fault]\nkill_rank = "none"\n', "[fault] kill_rank: expected int or none"),
        ("run_dir = 3\n", "run_dir: expected str, got 3 (int)"),
        ("model = 3\n", "model must be a table ([model]), got 3"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_a_wrong_type_in_the_toml_file_names_the_file_the_key_and_the_type(
    tmp_path, text, expected
):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and expected in str(info.value)


def test_a_type_error_shows_the_default_as_an_example():
    with pytest.raises(ConfigError, match="for example the default, 30$"):
        load_config(TINY_CONFIG, ["--train.steps", "ten"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["--trian.steps", "3"],
            "--trian.steps: unknown section 'trian'; did you mean 'train'? "
            "valid sections: model, parallel, train, checkpoint, fault, ft",
        ),
        (
            ["--train.stpes=3"],
            "--train.stpes: unknown key 'stpes' in [train]; did you mean 'steps'? "
            "valid keys of [train]: steps, seq_len, global_batch, lr,",
        ),
        (
            ["--rundir", "x"],
            "--rundir: unknown section or key 'rundir'; did you mean 'run_dir'? "
            "valid sections and top-level keys: model, parallel, train, checkpoint, fault, ft, run_dir",
        ),
        (["--train.a.b=1"], "--train.a.b: unknown key 'a.b' in [train]; valid keys of [train]:"),
    ],
)
def test_an_unknown_override_lists_the_valid_names_and_the_closest_one(overrides, expected):
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        load_config(TINY_CONFIG, overrides)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[modle]\ndim = 3\n", "unknown section or key 'modle'; did you mean 'model'?"),
        ("[model]\ndims = 3\n", "[model]: unknown key 'dims' in [model]; did you mean 'dim'?"),
        ("steps = 3\n", "unknown section or key 'steps'; valid sections and top-level keys:"),
    ],
)
def test_an_unknown_name_in_the_toml_file_lists_the_valid_ones(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize("arg", ["train.steps=3", "--", "-x"])
def test_an_override_without_two_dashes_is_refused(arg):
    with pytest.raises(ConfigError, match="expected an override like --train.steps 10"):
        load_config(TINY_CONFIG, [arg])


# Each rule with a config that breaks it alone, and a piece of the message: the values in conflict
# and the fix. Sizes are chosen so that no other rule fires.
RULES = [
    (["--model.n_kv_heads=3"], "model.n_heads (4) is not divisible by model.n_kv_heads (3)"),
    (["--model.dim=66"], "model.dim (66) is not divisible by model.n_heads (4)"),
    (["--model.dim=12"], "(12 / 4 = 3) is odd, and RoPE rotates pairs"),
    (["--model.vocab_size=100"], "model.vocab_size (100) is below 256"),
    (["--model.n_experts=1"], "model.top_k (2) exceeds model.n_experts (1)"),
    (
        ["--parallel.pp=3", "--parallel.pp_schedule=GPipe"],
        "model.n_layers (4) is not divisible by parallel.pp (3)",
    ),
    (
        ["--model.n_heads=6", "--model.n_kv_heads=3", "--model.dim=72", "--parallel.tp=2"],
        "model.n_kv_heads (3) is not divisible by parallel.tp (2)",
    ),
    (
        ["--model.ffn_dim=130", "--parallel.tp=4", "--model.n_kv_heads=4"],
        "model.ffn_dim (130) is not divisible by",
    ),
    (["--parallel.ep=2"], "parallel.ep (2) > 1 needs a mixture of experts"),
    (
        ["--model.n_experts=3", "--parallel.ep=2"],
        "model.n_experts (3) is not divisible by parallel.ep (2)",
    ),
    (
        ["--parallel.dp_shard=3"],
        "train.global_batch (8) is not divisible by the data-parallel degree "
        "dp_replicate * dp_shard * ep = 1 * 3 * 1 = 3; set global_batch to a multiple of 3",
    ),
    (
        [
            "--model.n_experts=4",
            "--parallel.ep=2",
            "--parallel.dp_replicate=2",
            "--parallel.dp_shard=3",
        ],
        "dp_replicate * dp_shard * ep = 2 * 3 * 2 = 12",
    ),
    (
        ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.microbatches=3"],
        "the per-rank batch global_batch / 2 = 4 is not divisible by parallel.microbatches (3)",
    ),
    (
        ["--parallel.pp=4", "--parallel.microbatches=2"],
        "parallel.microbatches (2) is below parallel.pp (4), which the 1F1B schedule needs",
    ),
    (["--parallel.cp=3"], "train.seq_len (32) is not divisible by 2 * parallel.cp (6)"),
    (["--train.seq_len=128"], "train.seq_len (128) exceeds model.max_seq_len (64)"),
    (
        ["--fault.kill_rank=0"],
        "fault.kill_rank (0) and fault.kill_step (None) must be set together",
    ),
    (
        ["--fault.kill_rank=2", "--fault.kill_step=3"],
        "fault.kill_rank (2) is not a rank of the world of 1",
    ),
    (
        ["--fault.kill_rank=0", "--fault.kill_step=31"],
        "fault.kill_step (31) is after the last step (train.steps = 30)",
    ),
    (["--train.steps=0"], "train.steps must be in [1, inf); got 0"),
    (["--train.lr=0"], "train.lr must be in (0, inf); got 0.0"),
    (["--train.beta2=1"], "train.beta2 must be in [0, 1); got 1.0"),
    (["--train.min_lr_ratio=1.5"], "train.min_lr_ratio must be in [0, 1]; got 1.5"),
    (["--model.n_experts=-1"], "model.n_experts must be in [0, inf); got -1"),
    (["--parallel.tp=0"], "parallel.tp must be in [1, inf); got 0"),
    (["--checkpoint.keep_last=0"], "checkpoint.keep_last must be in [1, inf); got 0"),
    (["--parallel.pp_schedule=ZB"], "parallel.pp_schedule must be one of '1F1B', 'GPipe'"),
    (["--checkpoint.storage=gcs"], "checkpoint.storage must be one of 'local', 's3'; got 'gcs'"),
    (["--fault.mode=segv"], "fault.mode must be one of 'sigkill', 'raise'; got 'segv'"),
    (
        ["--ft.replicas=2", "--parallel.dp_shard=2", "--ft.heal_layout=pp=2"],
        "ft.heal_layout (pp=2) differs from the configured layout and one of them has pipeline "
        "stages (pp=2)",
    ),
    (
        ["--ft.replicas=2", "--parallel.dp_shard=2", "--ft.heal_layout=dp_shard=4"],
        "ft.heal_layout (dp_shard=4) has 4 ranks, a group 2",
    ),
    (
        ["--ft.replicas=2", "--parallel.dp_shard=2", "--parallel.relayout_at=3:pp=2"],
        "parallel.relayout_at (3:pp=2): under FT-HSDP a group that changes layout averages its "
        "gradients with groups of another layout, which works only without pipeline stages "
        "(pp=2)",
    ),
    (
        [
            "--ft.replicas=2",
            "--parallel.tp=2",
            "--train.global_batch=6",
            "--parallel.relayout_at=3:dp_shard=2",
        ],
        "parallel.relayout_at (3:dp_shard=2): train.global_batch (6) is not divisible by "
        "ft.replicas * its data-parallel degree = 2 * 2",
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), RULES, ids=[e[:40] for _, e in RULES])
def test_every_validation_rule_rejects_a_config_that_breaks_it(overrides, expected):
    with pytest.raises(ValueError) as info:
        load_config(TINY_CONFIG, overrides)
    message = str(info.value)
    assert message.startswith("invalid configuration:\n  - ") and expected in message
    assert message.count("\n  - ") == 1, message  # this rule alone


def test_query_heads_not_divisible_by_tp_are_reported_with_the_key_value_heads():
    # n_kv_heads divides n_heads, so whenever tp does not divide n_heads it does not divide
    # n_kv_heads either: the n_heads rule never fires alone
    with pytest.raises(ConfigError) as info:
        load_config(TINY_CONFIG, ["--model.n_heads=6", "--model.dim=72", "--parallel.tp=4"])
    assert str(info.value).splitlines()[1:] == [
        "  - model.n_heads (6) is not divisible by parallel.tp (4): tensor parallelism splits "
        "the attention heads; set tp to one of 1, 2, 3, 6 or n_heads to a multiple of 4",
        "  - model.n_kv_heads (2) is not divisible by parallel.tp (4): tensor parallelism splits "
        "the key/value heads; set tp to one of 1, 2 or n_kv_heads to a multiple of 4",
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallel.pp=4", "--parallel.microbatches=2", "--parallel.pp_schedule=GPipe"],
        ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.microbatches=4"],
        ["--model.n_experts=4", "--parallel.ep=2", "--parallel.dp_shard=2", "--parallel.tp=2"],
        ["--parallel.cp=2", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
        ["--parallel.cp=3", "--train.seq_len=36"],
        ["--fault.kill_rank=3", "--fault.kill_step=30", "--parallel.tp=2", "--parallel.dp_shard=2"],
    ],
)
def test_layouts_that_fit_validate(overrides):
    load_config(TINY_CONFIG, overrides)


def test_all_problems_are_reported_at_once_and_sorted():
    with pytest.raises(ConfigError) as info:
        validate(
            Config(
                model=ModelConfig(n_kv_heads=3), parallel=ParallelConfig(dp_shard=5), run_dir="r"
            )
        )
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 2 and lines == sorted(lines)
    assert lines[0].startswith("  - model.n_heads") and lines[1].startswith("  - train.global")


SAMPLE = Config(
    model=ModelConfig(n_experts=4, top_k=1, norm_eps=1e-7, rope_theta=5e5, tie_embeddings=True),
    parallel=ParallelConfig(pp=2, dp_shard=2, pp_schedule="GPipe", microbatches=4),
    train=TrainConfig(steps=7, lr=1.25e-4, grad_clip=0.0, seed=12345),
    checkpoint=CheckpointConfig(root='s3://b/"odd" \\path\t\u00e9\u4e2d', local_dir="/tmp/l"),
    fault=FaultConfig(kill_rank=3, kill_step=7, mode="raise", only_first_attempt=False),
    run_dir="runs/\u00fcber\nline",
)


@pytest.mark.parametrize("cfg", [Config(), SAMPLE], ids=["defaults", "sample"])
def test_dump_toml_reads_back_equal(tmp_path, cfg):
    text = dump_toml(cfg)
    assert loads_config(text) == cfg
    assert load_config(_write(tmp_path, text)) == cfg


def test_dump_toml_leaves_none_out_and_writes_run_dir_before_the_tables():
    lines = dump_toml(Config()).splitlines()
    assert lines[0] == 'run_dir = "runs/demo"'
    assert [line for line in lines if line.startswith("[")] == [
        "[model]",
        "[parallel]",
        "[train]",
        "[checkpoint]",
        "[fault]",
        "[ft]",
    ]
    assert not any(line.startswith(("local_dir", "kill_rank", "kill_step")) for line in lines)


def test_config_to_dict_holds_json_values_per_section():
    values = config_to_dict(SAMPLE)
    assert values["parallel"]["pp_schedule"] == "GPipe" and values["fault"]["kill_rank"] == 3
    assert set(values) == {"model", "parallel", "train", "checkpoint", "fault", "ft", "run_dir"}


def test_a_config_is_frozen_and_copies_as_spawned_ranks_receive_it():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLE.train.steps = 3  # type: ignore[misc]
    # deepcopy takes the path pickling takes (__reduce_ex__), which frozen slots break on 3.10
    assert copy.deepcopy(SAMPLE) == SAMPLE


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("1:7:sigkill", {"kill_rank": 1, "kill_step": 7, "mode": "sigkill"}),
        ("0:3:raise", {"kill_rank": 0, "kill_step": 3, "mode": "raise"}),
        (" 2:5 ", {"kill_rank": 2, "kill_step": 5}),
        ("", {}),
    ],
)
def test_anyshard_fault_is_rank_step_and_an_optional_mode(text, fields):
    assert parse_fault_env(text) == fields


@pytest.mark.parametrize("text", ["1", "1:2:3:4", "a:2", "1:b", "1:2:segv", "1:2:"])
def test_a_malformed_anyshard_fault_says_the_expected_form(text):
    with pytest.raises(ConfigError, match="ANYSHARD_FAULT=.*expected rank:step\\[:mode\\]"):
        parse_fault_env(text)


def test_anyshard_fault_overrides_the_file_and_the_command_line(tmp_path, monkeypatch):
    path = _write(tmp_path, "[fault]\nkill_rank = 0\nkill_step = 2\nmode = 'raise'\n")
    argv = ["--parallel.dp_shard=2", "--fault.kill_step=4"]
    assert load_config(path, argv).fault == FaultConfig(kill_rank=0, kill_step=4, mode="raise")
    monkeypatch.setenv(FAULT_ENV, "1:7")  # no mode: the configured one stays
    assert load_config(path, argv).fault == FaultConfig(kill_rank=1, kill_step=7, mode="raise")
    env = {FAULT_ENV: "1:5:sigkill"}  # an explicit environ replaces os.environ
    assert load_config(path, argv, environ=env).fault == FaultConfig(kill_rank=1, kill_step=5)
    assert load_config(path, argv, environ={}).fault.kill_rank == 0


def test_anyshard_fault_is_validated_with_the_rest():
    with pytest.raises(
        ConfigError, match="fault.kill_rank \\(5\\) is not a rank of the world of 1"
    ):
        load_config(TINY_CONFIG, environ={FAULT_ENV: "5:3"})


def test_the_docstring_examples_run():
    from anyshard.trainer_integration.gpt.config import checks, parsing, schema

    results = [
        doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        for module in (config_module, schema, checks, parsing)
    ]
    assert sum(r.attempted for r in results) > 0 and sum(r.failed for r in results) == 0


def test_the_tiny_configuration_is_the_default_one_scaled_down():
    tiny = load_config(TINY_CONFIG, environ={})
    assert (tiny.model.dim, tiny.model.ffn_dim, tiny.train.seq_len, tiny.train.global_batch) == (
        64,
        128,
        32,
        8,
    )
    assert tiny.parallel == ParallelConfig() and tiny.checkpoint == Config().checkpoint


def test_relayout_at_parses_and_names_what_is_wrong():
    ok = load_config(
        TINY_CONFIG,
        ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.relayout_at=3:tp=2,dp_shard=2"],
        environ={},
    )
    step, layout = ok.parallel.relayout()
    assert step == 3 and (layout.pp, layout.dp_shard, layout.tp) == (1, 2, 2)
    base = ["--parallel.pp=2", "--parallel.dp_shard=2"]
    with pytest.raises(ConfigError, match=r"expected STEP:dim=n"):
        load_config(TINY_CONFIG, [*base, "--parallel.relayout_at=3-tp=2"], environ={})
    with pytest.raises(ConfigError, match=r"has 2 ranks, the job 4"):
        load_config(TINY_CONFIG, [*base, "--parallel.relayout_at=3:tp=2"], environ={})
    with pytest.raises(ConfigError, match=r"the step must lie in \[1, train.steps\)"):
        load_config(TINY_CONFIG, [*base, "--parallel.relayout_at=0:dp_shard=4"], environ={})
