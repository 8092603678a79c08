"""mpidp.config: defaults, MPIDP_*/HOROVOD_* parsing, strict errors, overrides, describe(), the
declared frozen Config that KNOBS is read from, and the launcher variables."""

import dataclasses
import math

import pytest

from mpidp import config
from mpidp.errors import ConfigError, MpidpError
from mpidp.runtime import unknown_vars
from mpidp.tools import knob_docs

MiB = 1024 * 1024

DEFAULTS = {
    "fusion_threshold_bytes": 4 * MiB,
    "fuse_below_bytes": 64 * 1024,
    "chunk_bytes": 4 * MiB,
    "cycle_time_ms": 0.0,
    "bucket_bytes": 25 * MiB,
    "first_bucket_bytes": 1 * MiB,
    "last_bucket_bytes": 0,
    "overlap": "auto",
    "overlap_trial_steps": 3,
    "reduce_in_backward": True,
    "keep_freed_memory": True,
    "cache_capacity": 1024,
    "stall_warning_s": 60.0,
    "stall_shutdown_s": 0.0,
    "order_check_s": 1.0,
    "log_level": "warning",
    "abort_on_error": True,
    "timeline_path": "",
    "timeline_mark_cycles": False,
    "backend": "auto",
    "cuda_aware_mpi": "auto",
    "hierarchical_allreduce": False,
    "simulated_local_size": 0,
    "rendezvous_host": "",
    "autotune": False,
    "autotune_log": "",
    "autotune_warmup_samples": 1,
    "autotune_samples_per_point": 3,
    "autotune_sample_s": 0.5,
    "elastic_checkpoint": "",
}

HOROVOD_ALIASES = [
    ("HOROVOD_FUSION_THRESHOLD", "fusion_threshold_bytes", "1048576", 1048576),
    ("HOROVOD_CYCLE_TIME", "cycle_time_ms", "2.5", 2.5),
    ("HOROVOD_CACHE_CAPACITY", "cache_capacity", "16", 16),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "stall_warning_s", "30", 30.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_s", "120", 120.0),
    ("HOROVOD_LOG_LEVEL", "log_level", "DEBUG", "debug"),
    ("HOROVOD_TIMELINE", "timeline_path", "/tmp/tl.json", "/tmp/tl.json"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", "1", True),
    ("HOROVOD_AUTOTUNE", "autotune", "1", True),
]


def test_every_knob_has_a_default_listed_here():
    assert {k.field for k in config.KNOBS} == set(DEFAULTS)


def test_defaults_with_empty_environment():
    cfg = config.load({})
    for field, value in DEFAULTS.items():
        assert getattr(cfg, field) == value, field
    assert cfg.explicit == frozenset()


def test_load_reads_os_environ_when_no_mapping_given(monkeypatch):
    monkeypatch.setenv("MPIDP_CACHE_CAPACITY", "7")
    assert config.load().cache_capacity == 7


@pytest.mark.parametrize(
    "var, field, raw, expected",
    [
        ("MPIDP_FUSION_THRESHOLD_BYTES", "fusion_threshold_bytes", "1024", 1024),
        ("MPIDP_FUSION_THRESHOLD_BYTES", "fusion_threshold_bytes", " 0 ", 0),
        ("MPIDP_FUSION_THRESHOLD_BYTES", "fusion_threshold_bytes", "0x100", 256),
        ("MPIDP_FUSE_BELOW_BYTES", "fuse_below_bytes", "4096", 4096),
        ("MPIDP_CHUNK_BYTES", "chunk_bytes", "0", 0),
        ("MPIDP_CYCLE_TIME_MS", "cycle_time_ms", "1.5", 1.5),
        ("MPIDP_OVERLAP", "overlap", "0", "0"),
        ("MPIDP_OVERLAP_TRIAL_STEPS", "overlap_trial_steps", "0", 0),
        ("MPIDP_REDUCE_IN_BACKWARD", "reduce_in_backward", "0", False),
        ("MPIDP_KEEP_FREED_MEMORY", "keep_freed_memory", "0", False),
        ("MPIDP_BUCKET_BYTES", "bucket_bytes", "1048576", 1048576),
        ("MPIDP_FIRST_BUCKET_BYTES", "first_bucket_bytes", "0", 0),
        ("MPIDP_LAST_BUCKET_BYTES", "last_bucket_bytes", "4194304", 4 * MiB),
        ("MPIDP_CACHE_CAPACITY", "cache_capacity", "0", 0),
        ("MPIDP_STALL_WARNING_S", "stall_warning_s", "0", 0.0),
        ("MPIDP_STALL_SHUTDOWN_S", "stall_shutdown_s", "300", 300.0),
        ("MPIDP_LOG_LEVEL", "log_level", "Info", "info"),
        ("MPIDP_LOG_LEVEL", "log_level", "trace", "trace"),
        ("MPIDP_ABORT_ON_ERROR", "abort_on_error", "0", False),
        ("MPIDP_TIMELINE", "timeline_path", " /tmp/t.json ", "/tmp/t.json"),
        ("MPIDP_ELASTIC_CHECKPOINT", "elastic_checkpoint", " /tmp/e.pt ", "/tmp/e.pt"),
        ("MPIDP_BACKEND", "backend", "Gloo", "gloo"),
        ("MPIDP_CUDA_AWARE_MPI", "cuda_aware_mpi", "1", "1"),
        ("MPIDP_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", "yes", True),
        ("MPIDP_SIMULATED_LOCAL_SIZE", "simulated_local_size", "2", 2),
        ("MPIDP_AUTOTUNE", "autotune", "1", True),
    ],
)
def test_mpidp_variables_are_parsed(var, field, raw, expected):
    cfg = config.load({var: raw})
    value = getattr(cfg, field)
    assert value == expected
    assert type(value) is type(expected)
    assert cfg.explicit == frozenset({field})


@pytest.mark.parametrize("var, field, raw, expected", HOROVOD_ALIASES)
def test_horovod_aliases(var, field, raw, expected):
    cfg = config.load({var: raw})
    assert getattr(cfg, field) == expected
    assert field in cfg.explicit


@pytest.mark.parametrize("var, field, raw, expected", HOROVOD_ALIASES)
def test_mpidp_variable_wins_over_horovod_alias(var, field, raw, expected):
    knob = next(k for k in config.KNOBS if k.field == field)
    assert knob.horovod == var
    mine = {"log_level": "info", "timeline_path": "/tmp/mine.json"}.get(field, "3")
    if isinstance(expected, bool):
        mine = "0"
    cfg = config.load({var: raw, knob.env: mine})
    assert getattr(cfg, field) == knob.parse(mine)
    assert getattr(cfg, field) != expected


def test_mpidp_variable_wins_even_when_alias_is_malformed():
    # Only the variable that is used is parsed.
    cfg = config.load({"HOROVOD_CACHE_CAPACITY": "lots", "MPIDP_CACHE_CAPACITY": "5"})
    assert cfg.cache_capacity == 5


@pytest.mark.parametrize(
    "var, raw",
    [
        ("MPIDP_FUSION_THRESHOLD_BYTES", "-1"),
        ("MPIDP_FUSION_THRESHOLD_BYTES", "4MiB"),
        ("MPIDP_FUSION_THRESHOLD_BYTES", "1.5"),
        ("MPIDP_FUSION_THRESHOLD_BYTES", ""),
        ("MPIDP_FUSE_BELOW_BYTES", "abc"),
        ("MPIDP_CHUNK_BYTES", "-4096"),
        ("MPIDP_CACHE_CAPACITY", "-1"),
        ("MPIDP_CACHE_CAPACITY", "1e3"),
        ("MPIDP_CYCLE_TIME_MS", "-0.5"),
        ("MPIDP_CYCLE_TIME_MS", "nan"),
        ("MPIDP_CYCLE_TIME_MS", "fast"),
        ("MPIDP_BUCKET_BYTES", "-1"),
        ("MPIDP_STALL_WARNING_S", "-60"),
        ("MPIDP_STALL_SHUTDOWN_S", "nan"),
        ("MPIDP_LOG_LEVEL", "verbose"),
        ("MPIDP_LOG_LEVEL", ""),
        ("HOROVOD_FUSION_THRESHOLD", "-5"),
        ("HOROVOD_CYCLE_TIME", "nan"),
        ("HOROVOD_CACHE_CAPACITY", "many"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "-1"),
        ("HOROVOD_LOG_LEVEL", "loud"),
        ("MPIDP_BACKEND", "mpich"),
        ("MPIDP_CUDA_AWARE_MPI", "maybe"),
        ("MPIDP_ABORT_ON_ERROR", "2"),
        ("MPIDP_SIMULATED_LOCAL_SIZE", "-2"),
    ],
)
def test_malformed_value_raises_config_error_naming_variable_and_value(var, raw):
    with pytest.raises(ConfigError) as info:
        config.load({var: raw})
    message = str(info.value)
    assert var in message
    assert repr(raw) in message
    # ConfigError is both mpidp's own error and a ValueError.
    assert isinstance(info.value, MpidpError)
    assert isinstance(info.value, ValueError)


def test_bad_log_level_message_lists_accepted_levels():
    with pytest.raises(ConfigError, match="trace, debug, info, warning, error, fatal"):
        config.load({"MPIDP_LOG_LEVEL": "chatty"})


def test_overrides_by_field_name():
    cfg = config.load({}, cache_capacity=3, log_level="error")
    assert cfg.cache_capacity == 3
    assert cfg.log_level == "error"
    assert cfg.explicit == frozenset({"cache_capacity", "log_level"})


def test_override_wins_over_environment():
    cfg = config.load({"MPIDP_CACHE_CAPACITY": "8", "HOROVOD_CYCLE_TIME": "2"}, cache_capacity=4)
    assert cfg.cache_capacity == 4
    assert cfg.cycle_time_ms == 2.0
    assert cfg.explicit == frozenset({"cache_capacity", "cycle_time_ms"})


def test_unknown_override_field_raises():
    with pytest.raises(ConfigError, match="unknown mpidp knob 'fusion_threshold'"):
        config.load({}, fusion_threshold=1)


def test_unknown_override_lists_known_fields():
    with pytest.raises(ConfigError) as info:
        config.load({}, no_such_knob=True)
    for field in DEFAULTS:
        assert field in str(info.value)


def test_explicit_records_env_and_overrides_only():
    cfg = config.load(
        {
            "MPIDP_CHUNK_BYTES": "4194304",
            "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",
            "UNRELATED": "x",
        },
        stall_shutdown_s=0.0,
    )
    # Set to the default value still counts as set.
    assert cfg.chunk_bytes == DEFAULTS["chunk_bytes"]
    assert cfg.explicit == frozenset({"chunk_bytes", "stall_warning_s", "stall_shutdown_s"})


def test_describe_lists_every_knob_variable_alias_and_default():
    text = knob_docs.describe()
    lines = text.splitlines()
    assert len(lines) == len(config.KNOBS)
    for knob, line in zip(config.KNOBS, lines):
        assert line.startswith(knob.env)
        assert repr(knob.default) in line
        assert knob.doc in line
        if knob.horovod:
            assert f"alias {knob.horovod}" in line


def test_agreed_items_excludes_log_level():
    cfg = config.load({})
    fields = [f for f, _ in cfg.agreed_items()]
    assert "log_level" not in fields
    local = {
        "log_level",
        "abort_on_error",
        "timeline_path",
        "timeline_mark_cycles",
        "autotune_log",
        "autotune_warmup_samples",
        "autotune_samples_per_point",
        "autotune_sample_s",
        "elastic_checkpoint",
        "overlap",
        "overlap_trial_steps",
        "keep_freed_memory",
    }
    assert set(fields) == set(DEFAULTS) - local
    assert dict(cfg.agreed_items())["cache_capacity"] == 1024


@pytest.mark.parametrize(
    "field, value", [("cache_capacity", -1), ("log_level", "loud"), ("cycle_time_ms", math.nan)]
)
def test_malformed_override_raises_config_error(field, value):
    with pytest.raises(ConfigError, match=field):
        config.load({}, **{field: value})


@pytest.mark.parametrize("var", ["MPIDP_CYCLE_TIME_MS", "MPIDP_STALL_WARNING_S"])
def test_infinite_sleep_time_is_rejected(var):
    with pytest.raises(ConfigError, match=var):
        config.load({var: "inf"})


def test_unknown_variables_name_the_closest_knob():
    env = {
        "MPIDP_CYCLE_TIME_MS": "1",
        "MPIDP_CYCLETIME_MS": "1",
        "HOROVOD_FUSION_THRESHOLD": "1",
        "HOROVOD_FUSION_THRESHHOLD": "2",
        "HOROVOD_GPU_OPERATIONS": "NCCL",
        "MPIDP_ZZZ": "1",
        "MPIDP_VENV": "/v",
        "PATH": "/bin",
    }
    got = dict(unknown_vars.unknown_variables(env))
    assert set(got) == {
        "MPIDP_CYCLETIME_MS",
        "HOROVOD_FUSION_THRESHHOLD",
        "HOROVOD_GPU_OPERATIONS",
        "MPIDP_ZZZ",
    }, got
    assert got["MPIDP_CYCLETIME_MS"].endswith("did you mean MPIDP_CYCLE_TIME_MS?")
    assert got["HOROVOD_FUSION_THRESHHOLD"].endswith("did you mean HOROVOD_FUSION_THRESHOLD?")
    assert got["HOROVOD_GPU_OPERATIONS"] == "a Horovod setting mpidp does not have; ignored"
    assert "doctor" in got["MPIDP_ZZZ"]
    assert unknown_vars.unknown_variables({}) == []


def test_real_horovod_settings_are_not_taken_for_misspelled_knobs():
    """HOROVOD_HIERARCHICAL_ALLGATHER is Horovod's own, not a misspelled ..._ALLREDUCE; dynamic
    process sets, which Horovod must be told about, are always on here."""
    env = {"HOROVOD_HIERARCHICAL_ALLGATHER": "1", "HOROVOD_DYNAMIC_PROCESS_SETS": "1"}
    got = dict(unknown_vars.unknown_variables(env))
    assert got == {
        "HOROVOD_HIERARCHICAL_ALLGATHER": "a Horovod setting mpidp does not have; ignored"
    }, got


@pytest.mark.parametrize(
    "env, warning, shutdown",
    [
        ({"HOROVOD_STALL_CHECK_DISABLE": "1"}, 0.0, 0.0),
        (
            {"HOROVOD_STALL_CHECK_DISABLE": "true", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"},
            0.0,
            9.0,
        ),
        ({"HOROVOD_STALL_CHECK_DISABLE": "0"}, 60.0, 0.0),
    ],
)
def test_horovods_stall_check_disable_turns_both_stall_knobs_off(env, warning, shutdown):
    """horovodrun --no-stall-check sets it; a stall knob set by itself still counts."""
    cfg = config.load(env)
    assert (cfg.stall_warning_s, cfg.stall_shutdown_s) == (warning, shutdown)
    assert unknown_vars.unknown_variables(env) == []


def test_a_bad_stall_check_disable_value_names_the_variable():
    with pytest.raises(ConfigError, match="HOROVOD_STALL_CHECK_DISABLE='maybe'"):
        config.load({"HOROVOD_STALL_CHECK_DISABLE": "maybe"})


def test_config_fields_are_the_knobs_in_order_then_explicit():
    fields = [f.name for f in dataclasses.fields(config.Config)]
    assert fields == [k.field for k in config.KNOBS] + ["explicit"]
    assert config.Config.__module__ == "mpidp.config" and config.Config.__doc__


def test_each_knob_field_is_declared_with_the_type_of_its_default():
    """Config's fields are declared, typed, once: KNOBS is read from them, not written again."""
    knobs = {k.field: k for k in config.KNOBS}
    for f in dataclasses.fields(config.Config):
        if f.name in knobs:
            assert type(f.default) is f.type and knobs[f.name].default == f.default, f.name
            assert knobs[f.name].env == f.metadata[config._KNOB]["env"]


def test_config_is_immutable_and_changed_by_replace():
    cfg = config.load({}, cache_capacity=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache_capacity = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.explicit = frozenset()
    changed = dataclasses.replace(cfg, elastic_checkpoint="/tmp/e.pt")
    assert changed.elastic_checkpoint == "/tmp/e.pt" and changed.cache_capacity == 3
    assert cfg.elastic_checkpoint == "" and changed != cfg
    assert config.load({}, cache_capacity=3) == cfg  # equal values, equal configs


@pytest.mark.parametrize(
    "env, rank",
    [
        ({}, None),
        ({"PMI_RANK": "2"}, 2),
        ({"PMIX_RANK": "1"}, 1),
        ({"OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "x"}, 3),
        ({"PMI_RANK": "0", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5"}, 0),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "4"}, 4),
        ({"SLURM_PROCID": "0"}, None),  # the batch script itself, outside any step
    ],
)
def test_launcher_rank(env, rank):
    assert config.launcher_rank(env) == rank


def test_launcher_rank_reads_os_environ_when_no_mapping_given(monkeypatch):
    for var in config.LAUNCHER_RANK_VARIABLES + ("SLURM_STEP_ID",):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMIX_RANK", "6")
    assert config.launcher_rank() == 6


def test_launcher_variables_are_covered_by_the_prefixes():
    every = config.LAUNCHER_RANK_VARIABLES + config.LAUNCHER_SIZE_VARIABLES + ("SLURM_PROCID",)
    assert all(var.startswith(config.LAUNCHER_PREFIXES) for var in every)
    assert not any(
        var.startswith(config.LAUNCHER_PREFIXES)
        for k in config.KNOBS
        for var in (k.env, k.horovod)
        if var
    )
