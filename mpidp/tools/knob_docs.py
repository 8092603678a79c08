"""The knob table, rendered from config.KNOBS (`python -m mpidp.tools.knob_docs --help`)."""

import argparse
import sys
from typing import Iterable, Optional, Sequence

from ..config import KNOBS, Knob, MiB

BEGIN = "<!-- knobs:begin -->"
END = "<!-- knobs:end -->"
COMMAND = "python -m mpidp.tools.knob_docs --write docs/knobs.md"


def _default(knob: Knob) -> str:
    """The default as one would write it in the variable."""
    value = knob.default
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if value == "":
        return "empty"
    if isinstance(value, int) and knob.env.endswith("_BYTES") and value and value % 1024 == 0:
        size = f"{value // MiB} MiB" if value % MiB == 0 else f"{value // 1024} KiB"
        return f"`{value}` ({size})"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(knobs: Iterable[Knob] = KNOBS) -> str:
    """The markdown that goes between BEGIN and END: one table row per knob (variable, Horovod
    alias, init() keyword, default, what it does), ending in a blank line."""
    lines = [
        f"<!-- generated from KNOBS in mpidp/config.py by `{COMMAND}`; edit Config's fields -->",
        "",
        "| Variable | Horovod alias | `init()` keyword | Default | What it does |",
        "|---|---|---|---|---|",
    ]
    for k in knobs:
        alias = f"`{k.horovod}`" if k.horovod else ""
        doc = k.doc if k.must_agree else f"{k.doc} May differ between ranks."
        lines.append(f"| `{k.env}` | {alias} | `{k.field}` | {_default(k)} | {_cell(doc)} |")
    # The blank line ends the table: a comment line right after it could be read as a row.
    return "\n".join(lines) + "\n\n"


def _bounds(text: str):
    begin = text.find(BEGIN + "\n")
    end = text.find("\n" + END, begin) if begin >= 0 else -1
    if end < 0:
        raise ValueError(f"no '{BEGIN}' line followed by an '{END}' line to put the table between")
    return begin + len(BEGIN) + 1, end + 1


def section(text: str) -> str:
    """What `text` (docs/knobs.md) holds between the BEGIN and END lines; ValueError if none."""
    start, stop = _bounds(text)
    return text[start:stop]


def rewrite(text: str, block: Optional[str] = None) -> str:
    """`text` with what lies between the BEGIN and END lines replaced by `block` (default: the
    table rendered from KNOBS); ValueError when the lines are missing."""
    start, stop = _bounds(text)
    return text[:start] + (render() if block is None else block) + text[stop:]


def describe() -> str:
    """Every knob in plain text, a line each: variables, default, doc (render() makes the
    markdown table of docs/knobs.md)."""
    lines = []
    for k in KNOBS:
        alias = f" (alias {k.horovod})" if k.horovod else ""
        lines.append(f"{k.env}{alias} = {k.default!r}: {k.doc}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table, or (--write) rewrite a file's table, or (--check) exit 1 if it is stale."""
    parser = argparse.ArgumentParser(prog="python -m mpidp.tools.knob_docs", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", help="rewrite FILE's table in place")
    group.add_argument("--check", metavar="FILE", help="exit 1 if FILE's table is not current")
    args = parser.parse_args(argv)
    path = args.write or args.check
    if path is None:
        sys.stdout.write(render())
        return 0
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        new = rewrite(text)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    if new == text:
        print(f"{path}: knob table is current")
        return 0
    if args.check:
        print(
            f"{path}: knob table differs from KNOBS; regenerate it with "
            f"`python -m mpidp.tools.knob_docs --write {path}`",
            file=sys.stderr,
        )
        return 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"{path}: knob table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
