"""mpidp.tools.knob_docs: docs/knobs.md's table is the one KNOBS renders; rewriting, the CLI."""

import difflib
from pathlib import Path

import pytest

from mpidp import config
from mpidp.tools import knob_docs

KNOBS_DOC = Path(__file__).resolve().parents[2] / "docs" / "knobs.md"


def test_the_knob_table_is_rendered_from_knobs():
    text = KNOBS_DOC.read_text(encoding="utf-8")
    have, want = knob_docs.section(text), knob_docs.render()
    diff = "".join(
        difflib.unified_diff(
            have.splitlines(True), want.splitlines(True), "docs/knobs.md", "rendered from KNOBS"
        )
    )
    assert have == want, (
        f"docs/knobs.md's knob table differs from KNOBS; regenerate it with "
        f"`{knob_docs.COMMAND}`\n{diff}"
    )


def test_table_has_a_row_per_knob_with_its_variables_field_and_doc():
    rows = [line for line in knob_docs.render().splitlines() if line.startswith("| `")]
    assert len(rows) == len(config.KNOBS)
    for knob, row in zip(config.KNOBS, rows):
        assert row.startswith(f"| `{knob.env}` | ")
        assert f"`{knob.field}`" in row and knob.doc in row
        assert (f"`{knob.horovod}`" in row) if knob.horovod else (f"`{knob.env}` |  |" in row)
        assert row.endswith("May differ between ranks. |") != knob.must_agree


def test_every_horovod_alias_is_in_the_table():
    table = knob_docs.render()
    aliases = [k.horovod for k in config.KNOBS if k.horovod]
    assert aliases and all(f"`{alias}`" in table for alias in aliases)


@pytest.mark.parametrize(
    "field, shown",
    [
        ("fusion_threshold_bytes", "`4194304` (4 MiB)"),
        ("fuse_below_bytes", "`65536` (64 KiB)"),
        ("cycle_time_ms", "`0`"),
        ("autotune_sample_s", "`0.5`"),
        ("cache_capacity", "`1024`"),
        ("abort_on_error", "`1`"),
        ("autotune", "`0`"),
        ("timeline_path", "empty"),
        ("log_level", "`warning`"),
    ],
)
def test_defaults_are_written_as_the_variable_takes_them(field, shown):
    row = next(line for line in knob_docs.render().splitlines() if f"| `{field}` |" in line)
    assert f"| `{field}` | {shown} | " in row


def test_a_pipe_in_a_doc_does_not_split_the_row():
    knob = config.Knob("x", "MPIDP_X", str, "", "a | b")
    assert "| a \\| b |" in knob_docs.render([knob])


def test_rewrite_replaces_only_what_lies_between_the_markers():
    text = f"intro\n{knob_docs.BEGIN}\nold table\n{knob_docs.END}\noutro\n"
    new = knob_docs.rewrite(text, "new\n")
    assert new == f"intro\n{knob_docs.BEGIN}\nnew\n{knob_docs.END}\noutro\n"
    assert knob_docs.section(new) == "new\n"
    empty = f"{knob_docs.BEGIN}\n{knob_docs.END}\n"
    assert knob_docs.section(knob_docs.rewrite(empty)) == knob_docs.render()


@pytest.mark.parametrize(
    "text",
    ["no markers\n", f"{knob_docs.BEGIN}\nno end\n", f"{knob_docs.END}\n{knob_docs.BEGIN}\n"],
)
def test_missing_markers_are_an_error(text):
    with pytest.raises(ValueError, match="knobs:begin"):
        knob_docs.rewrite(text)


def test_cli_check_then_write(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text(f"# x\n{knob_docs.BEGIN}\nstale\n{knob_docs.END}\n", encoding="utf-8")
    assert knob_docs.main(["--check", str(path)]) == 1
    assert f"--write {path}" in capsys.readouterr().err
    assert knob_docs.main(["--write", str(path)]) == 0
    assert knob_docs.section(path.read_text(encoding="utf-8")) == knob_docs.render()
    assert knob_docs.main(["--check", str(path)]) == 0
    assert knob_docs.main([]) == 0
    assert capsys.readouterr().out.endswith(knob_docs.render())


def test_cli_without_markers_fails(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text("# no table here\n", encoding="utf-8")
    assert knob_docs.main(["--write", str(path)]) == 2
    assert "knobs:begin" in capsys.readouterr().err
    assert path.read_text(encoding="utf-8") == "# no table here\n"
