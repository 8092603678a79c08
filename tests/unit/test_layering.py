"""Imports point one way: the engine below the user-facing modules; mpi4py in two modules only."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpidp"

# What a module of each layer may import from mpidp. The foundation (errors, log, config) needs
# nothing above it; the engine (what its thread runs) needs only the foundation and itself.
FOUNDATION = {"mpidp.errors", "mpidp.log", "mpidp.config"}
ENGINE_MAY_IMPORT = FOUNDATION | {"mpidp.engine"}
# Only these talk to mpi4py: importing mpi4py.MPI initialises MPI, which init() must control.
MPI4PY_IMPORTERS = {"mpidp.engine.mpi", "mpidp.runtime"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """Absolute names of every module `path` imports (at any depth in the file), relative
    imports resolved; `from a import b` yields both a and a.b (b may be a submodule)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _within(name: str, allowed) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_where_the_rules_look():
    assert len(MODULES) > 40 and any(p.name == "engine.py" for p in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down(path):
    name = _module_name(path)
    wrong = []
    for target, line in _imports(path):
        if not target.startswith("mpidp") and not target.startswith("mpi4py"):
            continue
        if target.startswith("mpi4py") and name not in MPI4PY_IMPORTERS:
            wrong.append(f"line {line}: imports {target}; only {sorted(MPI4PY_IMPORTERS)} may")
        if name.startswith("mpidp.engine") and target.startswith("mpidp") \
                and not _within(target, ENGINE_MAY_IMPORT):
            wrong.append(f"line {line}: the engine imports {target}; it may import only "
                         f"{sorted(ENGINE_MAY_IMPORT)}")
        if name in FOUNDATION and target.startswith("mpidp") and not _within(target, FOUNDATION):
            wrong.append(f"line {line}: foundation module imports {target}")
        if _within(target, {"mpidp.torch"}) and not name.startswith("mpidp.torch"):
            wrong.append(f"line {line}: imports the Horovod-named alias package {target}")
    assert not wrong, f"{name}:\n  " + "\n  ".join(wrong)


def test_the_rules_catch_an_engine_module_importing_the_optimizer(tmp_path, monkeypatch):
    fake = PACKAGE / "engine" / "_layering_probe.py"
    source = '"""probe."""\nfrom ..optimizer import DistributedOptimizer\nimport mpi4py\n'
    monkeypatch.setattr(pathlib.Path, "read_text",
                        lambda self, *a, **k: source if self == fake else
                        pathlib.Path.read_bytes(self).decode())
    with pytest.raises(AssertionError) as info:
        test_imports_point_down(fake)
    assert "the engine imports mpidp.optimizer" in str(info.value)
    assert "imports mpi4py" in str(info.value)
