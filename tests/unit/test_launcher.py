"""mpidprun's translation of horovodrun flags into mpiexec argv and variables (MPICH, Open MPI)."""

import os
import shlex
import stat
import sys

import pytest

from mpidp import config
from mpidp.tools import launcher as L

MiB = 1024 * 1024


def _build(argv, flavor="mpich", environ=None, as_root=False):
    return L.build_command(
        L.parse_args(argv),
        flavor,
        "/mpi/bin/mpiexec",
        environ={} if environ is None else environ,
        as_root=as_root,
    )


def _usage_error(argv, flavor="mpich"):
    with pytest.raises(L.UsageError) as info:
        _build(argv, flavor)
    return str(info.value)


# ---- MPICH (hydra) ----


def test_mpich_plain_launch_is_n_and_the_command():
    cmd, env = _build(["-np", "4", "python", "train.py", "--lr", "0.1"])
    assert cmd == ["/mpi/bin/mpiexec", "-n", "4", "python", "train.py", "--lr", "0.1"]
    assert env == {}


def test_mpich_knobs_become_genv_and_hosts_become_hosts():
    cmd, env = _build(
        [
            "-np",
            "4",
            "-H",
            "node1:2,node2:2",
            "--fusion-threshold-mb",
            "32",
            "--cycle-time-ms",
            "2.5",
            "--autotune",
            "python",
            "t.py",
        ]
    )
    assert cmd == [
        "/mpi/bin/mpiexec",
        "-n",
        "4",
        "-hosts",
        "node1:2,node2:2",
        "-genv",
        "MPIDP_FUSION_THRESHOLD_BYTES",
        str(32 * MiB),
        "-genv",
        "MPIDP_CYCLE_TIME_MS",
        "2.5",
        "-genv",
        "MPIDP_AUTOTUNE",
        "1",
        "python",
        "t.py",
    ]
    assert env == {}


def test_mpich_start_timeout_reaches_ssh_through_hydra_and_keeps_user_options():
    _cmd, env = _build(["-np", "2", "--start-timeout", "45", "python", "t.py"])
    assert env == {"HYDRA_LAUNCHER_EXTRA_ARGS": "-o ConnectTimeout=45"}
    _cmd, env = _build(
        ["-np", "2", "--start-timeout", "45", "python", "t.py"],
        environ={"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222"},
    )
    assert env == {"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222 -o ConnectTimeout=45"}


def test_mpi_args_go_between_the_options_and_the_command():
    cmd, _ = _build(["-np", "2", "--mpi-args=-iface br0 -prepend-rank", "python", "t.py"])
    assert cmd == [
        "/mpi/bin/mpiexec",
        "-n",
        "2",
        "-iface",
        "br0",
        "-prepend-rank",
        "python",
        "t.py",
    ]
    cmd, _ = _build(["-np", "2", "--mpi-args", "--mca btl ^ofi", "python", "t.py"], "openmpi")
    assert cmd[-5:] == ["--mca", "btl", "^ofi", "python", "t.py"]


# ---- Open MPI ----


def test_openmpi_gets_np_localhost_slots_no_binding_and_x_for_knobs():
    cmd, env = _build(
        ["-np", "3", "--cache-capacity", "7", "--hierarchical-allreduce", "python", "t.py"],
        "openmpi",
    )
    # Open MPI refuses more ranks than cores without -H; horovodrun gives localhost -np slots.
    assert cmd == [
        "/mpi/bin/mpiexec",
        "-np",
        "3",
        "-H",
        "localhost:3",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "-x",
        "MPIDP_CACHE_CAPACITY=7",
        "-x",
        "MPIDP_HIERARCHICAL_ALLREDUCE=1",
        "python",
        "t.py",
    ]
    assert env == {}


def test_openmpi_hosts_root_and_start_timeout():
    cmd, env = _build(
        ["-np", "4", "-H", "a:2,b:2", "--start-timeout", "9", "python", "t.py"],
        "openmpi",
        as_root=True,
    )
    assert cmd == [
        "/mpi/bin/mpiexec",
        "-np",
        "4",
        "-H",
        "a:2,b:2",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "--allow-run-as-root",
        "--mca",
        "plm_rsh_args",
        "-o ConnectTimeout=9",
        "python",
        "t.py",
    ]
    assert env == {}


def test_openmpi_forwards_path_and_knob_variables_by_name_but_flags_win():
    environ = {
        "PATH": "/bin",
        "PYTHONPATH": "/src",
        "HOME": "/root",
        "MPIDP_BACKEND": "gloo",
        "HOROVOD_CACHE_CAPACITY": "5",
        "MPIDP_CYCLE_TIME_MS": "9",
    }
    cmd, _ = _build(["-np", "2", "--cycle-time-ms", "1", "python", "t.py"], "openmpi", environ)
    xs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert xs == [
        "MPIDP_CYCLE_TIME_MS=1.0",
        "HOROVOD_CACHE_CAPACITY",
        "MPIDP_BACKEND",
        "PATH",
        "PYTHONPATH",
    ]


# ---- hostfiles ----


@pytest.mark.parametrize(
    "text",
    [
        "node1 slots=2\nnode2 slots=3 max_slots=8\n",
        "# two hosts\nnode1:2\n\nnode2:3  # the big one\n",
    ],
)
def test_hostfile_in_either_syntax_becomes_the_host_list(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    cmd, _ = _build(["-np", "5", "--hostfile", str(path), "python", "t.py"])
    assert cmd[3:5] == ["-hosts", "node1:2,node2:3"]
    cmd, _ = _build(["-np", "5", "-hostfile", str(path), "python", "t.py"], "openmpi")
    assert cmd[3:5] == ["-H", "node1:2,node2:3"]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "node1 slots=2\nnode2\n",
            "line 2: 'node2' does not say how many slots; write 'node2 slots=N'",
        ),
        ("node1 slots=0\n", "line 1: 'node1:0' is not host:slots with slots >= 1"),
        ("# nothing\n", "names no host"),
    ],
)
def test_bad_hostfile_names_the_line(tmp_path, text, expected):
    path = tmp_path / "hosts"
    path.write_text(text)
    assert expected in _usage_error(["-np", "2", "--hostfile", str(path), "python", "t.py"])


@pytest.mark.parametrize("flavor", ["mpich", "openmpi"])
def test_more_ranks_than_slots_is_refused_as_horovodrun_does(tmp_path, flavor):
    message = _usage_error(["-np", "4", "-H", "localhost:2", "python", "t.py"], flavor)
    assert "-np 4 asks for more ranks than the 2 slots -H gives (localhost:2)" in message
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=1\n")
    message = _usage_error(["-np", "4", "--hostfile", str(path), "python", "t.py"], flavor)
    assert f"3 slots --hostfile {path} gives (a:2,b:1)" in message
    cmd, _ = _build(["-np", "3", "--hostfile", str(path), "python", "t.py"], flavor)
    assert "a:2,b:1" in cmd


def test_missing_hostfile_is_a_usage_error(tmp_path):
    message = _usage_error(["-np", "2", "--hostfile", str(tmp_path / "nope"), "python", "t.py"])
    assert "cannot read it" in message and "nope" in message


# ---- knob flags: the variable each sets, as mpidp.config reads it back ----


@pytest.mark.parametrize(
    "flags, field, value",
    [
        (["--fusion-threshold-mb", "0"], "fusion_threshold_bytes", 0),
        (["--fusion-threshold-mb", "64"], "fusion_threshold_bytes", 64 * MiB),
        (["--cycle-time-ms", "0.25"], "cycle_time_ms", 0.25),
        (["--cache-capacity=0"], "cache_capacity", 0),
        (["--hierarchical-allreduce"], "hierarchical_allreduce", True),
        (["--no-hierarchical-allreduce"], "hierarchical_allreduce", False),
        (["--autotune"], "autotune", True),
        (["--no-autotune"], "autotune", False),
        (["--autotune-log-file", "/tmp/at.csv"], "autotune_log", "/tmp/at.csv"),
        (["--autotune-warmup-samples", "4"], "autotune_warmup_samples", 4),
        (["--timeline-filename", "tl.json"], "timeline_path", "tl.json"),
        (["--timeline-mark-cycles"], "timeline_mark_cycles", True),
        (["--stall-check-warning-time-seconds", "30"], "stall_warning_s", 30.0),
        (["--stall-check-shutdown-time-seconds", "90"], "stall_shutdown_s", 90.0),
        (["--log-level", "DEBUG"], "log_level", "debug"),
        (["--log-level", "trace"], "log_level", "trace"),
    ],
)
def test_knob_flag_sets_the_mpidp_variable(flags, field, value):
    env = L.knob_env(L.parse_args(["-np", "1", *flags, "python"]))
    knob = next(k for k in config.KNOBS if k.field == field)
    assert list(env) == [knob.env]
    cfg = config.load(env=env)
    assert getattr(cfg, field) == value and cfg.explicit == {field}


def test_no_stall_check_turns_warning_and_shutdown_off():
    env = L.knob_env(L.parse_args(["-np", "1", "--no-stall-check", "python"]))
    assert env == {"MPIDP_STALL_WARNING_S": "0", "MPIDP_STALL_SHUTDOWN_S": "0"}
    assert "--no-stall-check turns the stall check off" in _usage_error(
        ["-np", "1", "--no-stall-check", "--stall-check-warning-time-seconds", "5", "python"]
    )


def test_a_value_mpidp_refuses_names_the_flag_and_the_variable():
    message = _usage_error(["-np", "1", "--cycle-time-ms", "inf", "python"])
    assert message.startswith("--cycle-time-ms inf: MPIDP_CYCLE_TIME_MS='inf' is not valid")


# ---- the command line itself ----


def test_options_after_the_command_belong_to_the_command():
    args = L.parse_args(["-np", "2", "python", "t.py", "--verbose", "-np", "8"])
    assert args.num_proc == 2 and not args.verbose
    assert args.command == ["python", "t.py", "--verbose", "-np", "8"]
    args = L.parse_args(["--verbose", "-np=3", "--", "-weird-program", "x"])
    assert args.verbose and args.num_proc == 3 and args.command == ["-weird-program", "x"]


def test_check_build_help_and_version_need_no_np_or_command():
    assert L.parse_args(["--check-build"]).check_build
    assert L.parse_args(["-cb"]).check_build
    assert L.parse_args(["-h"]).help and L.parse_args(["--version"]).version
    assert L.parse_args(["--disable-cache", "--mpi", "-np", "1", "x"]).command == ["x"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "t.py"], "-np is required: write -np N"),
        (["-np", "0", "python"], "-np must be >= 1, not 0"),
        (["-np", "-3", "python"], "-np must be >= 1, not -3"),
        (["-np", "two", "python"], "-np takes an integer, not 'two': write for example -np 2"),
        (["-np", "2"], "no command to run: write it after the options"),
        (["-np"], "-np needs a value: write -np N"),
        (
            ["-np", "2", "-H", "node1", "x"],
            "-H: 'node1' is not host:slots with slots >= 1; write for example -H node1:4,node2:4",
        ),
        (["-np", "2", "-H", "a:2,b:x", "x"], "'b:x' is not host:slots"),
        (
            ["-np", "2", "-H", "a:1", "--hostfile", "f", "x"],
            "-H and --hostfile both name the hosts",
        ),
        (
            ["-np", "2", "--fusion-threshold-mb", "-1", "x"],
            "--fusion-threshold-mb must be >= 0, not -1",
        ),
        (
            ["-np", "2", "--fusion-threshold-mb", "1.5", "x"],
            "--fusion-threshold-mb takes an integer",
        ),
        (["-np", "2", "--cycle-time-ms", "nan", "x"], "--cycle-time-ms must be >= 0, not nan"),
        (["-np", "2", "--start-timeout", "0", "x"], "--start-timeout must be >= 1, not 0"),
        (
            ["-np", "2", "--log-level", "loud", "x"],
            "--log-level 'loud' is not a level: write one "
            "of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL",
        ),
        (["-np", "2", "--autotune=1", "x"], "--autotune takes no value: write --autotune alone"),
        (["-np", "2", "--mpi-args", "'unclosed", "x"], "--mpi-args"),
        (
            ["-np", "2", "--frobnicate", "x"],
            "unknown option '--frobnicate': mpidprun takes horovodrun's options",
        ),
        (["-np", "2", "-genv", "A", "B", "x"], "mpiexec's own options go in --mpi-args="),
        (["-np", "2", "--gloo", "x"], "set MPIDP_BACKEND=gloo"),
        (["--min-np", "2", "-np", "4", "x"], "MPIDP_ELASTIC_CHECKPOINT"),
        (["-np", "2", "--network-interface", "eth0", "x"], "MPICH: -iface NIC"),
    ],
)
def test_bad_command_lines_say_what_to_write(argv, expected):
    assert expected in _usage_error(argv)


def test_main_exits_2_on_bad_input_and_prints_one_error_line(capsys):
    assert L.main(["-np", "0", "python", "t.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "mpidprun: error: -np must be >= 1, not 0\n"


def test_main_help_lists_the_flags_and_version_prints_it(capsys):
    assert L.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("-np", "--hostfile", "--fusion-threshold-mb", "--check-build", "--mpi-args"):
        assert flag in out
    assert L.main(["-v"]) == 0
    assert capsys.readouterr().out.strip() == "mpidprun (mpidp) 0.1.0"


# ---- finding and recognising mpiexec ----


@pytest.mark.parametrize(
    "text, flavor",
    [
        ("HYDRA build details:\n    Version:   5.0.2\n", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10\n", "mpich"),
        (
            "mpirun (Open MPI) 5.0.6\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
            "openmpi",
        ),
        ("mpirun (OpenRTE) 2.1.1\n", "openmpi"),
        ("srun: unrecognized option\n", None),
    ],
)
def test_flavor_of_version_output(text, flavor):
    assert L.flavor_of(text) == flavor


def _fake_mpiexec(directory, output):
    path = directory / "mpiexec"
    path.write_text(f"#!/bin/sh\necho {shlex.quote(output)}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_detect_flavor_runs_version(tmp_path):
    assert L.detect_flavor(_fake_mpiexec(tmp_path, "mpirun (Open MPI) 5.0.6")) == "openmpi"
    with pytest.raises(L.LaunchError, match="neither MPICH's nor Open MPI's"):
        L.detect_flavor(_fake_mpiexec(tmp_path, "something else"))


def test_find_mpiexec_prefers_the_one_beside_python_then_path(tmp_path, monkeypatch):
    (tmp_path / "venv").mkdir()
    (tmp_path / "mpi").mkdir()
    on_path = _fake_mpiexec(tmp_path / "mpi", "HYDRA")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "python"))
    assert L.find_mpiexec({"PATH": str(tmp_path / "mpi")}) == on_path
    beside = _fake_mpiexec(tmp_path / "venv", "HYDRA")
    assert L.find_mpiexec({"PATH": str(tmp_path / "mpi")}) == beside
    os.unlink(beside)
    with pytest.raises(L.LaunchError, match=r"pip install 'mpidp\[mpich\]'"):
        L.find_mpiexec({"PATH": str(tmp_path / "venv")})


def test_verbose_line_is_a_shell_command_that_runs_the_same_argv():
    cmd = ["/mpi/bin/mpiexec", "-n", "2", "python", "-c", "print('a b')"]
    line = L.format_command(cmd, {"HYDRA_LAUNCHER_EXTRA_ARGS": "-o ConnectTimeout=5"})
    assert line.startswith("HYDRA_LAUNCHER_EXTRA_ARGS='-o ConnectTimeout=5' /mpi/bin/mpiexec")
    assert shlex.split(line)[1:] == cmd
