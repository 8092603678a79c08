"""`python -m mpidp timeline FILE`: checks a timeline file, exit 0 with the event counts or 1
naming what is wrong."""

import json

from mpidp.__main__ import main


def _write(path, events, closed=True):
    """As the timeline writes: the separator before each event, "]" added by close()."""
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + ("\n]\n" if closed else "")
    path.write_text(text)


GOOD = [
    {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
    {"name": "op", "ph": "X", "pid": 0, "tid": 1, "ts": 10.0, "dur": 5.0},
    {"name": "mpi", "ph": "X", "pid": 0, "tid": 1, "ts": 11.0, "dur": 2.0},
]


def test_a_valid_timeline_and_one_cut_short(tmp_path, capsys):
    for closed in (True, False):
        path = tmp_path / f"t{closed}.json"
        _write(path, GOOD, closed)
        assert main(["timeline", str(path)]) == 0
        assert "valid trace, 3 events (1 M, 2 X)" in capsys.readouterr().out


def test_a_bad_event_or_no_file_exits_1_saying_why(tmp_path, capsys):
    path = tmp_path / "bad.json"
    _write(path, GOOD + [{"name": "x", "ph": "X", "pid": 0, "tid": 1, "ts": -1, "dur": 1}])
    assert main(["timeline", str(path)]) == 1
    assert "not a valid trace" in capsys.readouterr().err
    assert main(["timeline", str(tmp_path / "none.json")]) == 1
    assert "No such file" in capsys.readouterr().err
