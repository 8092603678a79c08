"""docs/architecture.md names every module of mpidp/ by its path, and no module that is gone."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpidp"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _modules():
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def _named():
    """Every `path.py` in backticks in the doc (its module tables name modules so)."""
    return set(re.findall(r"`([A-Za-z0-9_/]+\.py)`", ARCHITECTURE.read_text()))


def test_the_rule_looks_at_the_package():
    assert len(_modules()) > 60 and "engine/engine.py" in _modules()


def test_every_module_is_in_the_architecture_doc():
    missing = [m for m in _modules() if m not in _named()]
    assert not missing, (
        f"docs/architecture.md does not name {missing}: add a line for each "
        f"to its table 'The package, one line per module' (path under mpidp/)"
    )


def test_the_architecture_doc_names_no_module_that_is_gone():
    gone = sorted(
        n
        for n in _named()
        if "/" in n or n in {"__init__.py", "__main__.py"}
        if not (PACKAGE / n).exists() and not (ROOT / n).exists()
    )
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
