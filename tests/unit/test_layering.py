"""Imports point one way: wings in their order, the engine lowest; mpi4py in two modules only."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpidp"

# The foundation (errors, log, config) needs nothing above it; every wing may import it.
FOUNDATION = {"mpidp.errors", "mpidp.log", "mpidp.config"}
# The wings from the lowest up (docs/architecture.md): a module may import its own wing and
# those below it, never one above. The engine (what its thread runs) is the ground floor.
WINGS = ["engine", "runtime", "ops", "training", "sharded", "state", "distributed", "tools"]
# What mpidp/ may hold at its top besides the wings: the public face, the foundation and the
# documented user import paths (mpidp.checkpoint, mpidp.elastic, mpidp.torch, mpidp.common).
TOP = {
    "__init__.py",
    "__main__.py",
    "config.py",
    "errors.py",
    "log.py",
    "checkpoint.py",
    "elastic.py",
    "torch",
    "common",
}
# Only these talk to mpi4py (the engine's MPI package, every module of it, and the runtime):
# importing mpi4py.MPI initialises MPI, which init() must control.
MPI4PY_IMPORTERS = {"mpidp.engine.mpi", "mpidp.runtime.world"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path):
    """Absolute names of every module `path` imports (at any depth in the file), relative
    imports resolved; `from a import b` yields a.b (b may be a submodule or a name of a), and
    a itself only for `import a`."""
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
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def _within(name: str, allowed) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def _wing(name: str):
    """The wing a dotted name lies in (its index in WINGS), or None for the top level."""
    parts = name.split(".")
    return WINGS.index(parts[1]) if len(parts) > 1 and parts[1] in WINGS else None


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {_module_name(p) for p in MODULES}


def test_the_package_is_where_the_rules_look():
    assert len(MODULES) > 40 and any(p.name == "engine.py" for p in MODULES)


def test_the_top_level_is_the_wings_and_a_few_entries():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries - TOP - set(WINGS) == set(), "a new top-level entry: put it in a wing"
    assert set(WINGS) <= entries and len(TOP) <= 12


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down(path):
    name = _module_name(path)
    mine = _wing(name)
    wrong = []
    for target, line in _imports(path):
        if not target.startswith("mpidp") and not target.startswith("mpi4py"):
            continue
        if target.startswith("mpi4py") and not _within(name, MPI4PY_IMPORTERS):
            wrong.append(f"line {line}: imports {target}; only {sorted(MPI4PY_IMPORTERS)} may")
        if not target.startswith("mpidp"):
            continue
        if name in FOUNDATION and not _within(target, FOUNDATION):
            wrong.append(f"line {line}: foundation module imports {target}")
        if _within(target, {"mpidp.torch"}) and not name.startswith("mpidp.torch"):
            wrong.append(f"line {line}: imports the Horovod-named alias package {target}")
        if mine is None or _within(target, FOUNDATION):
            continue
        theirs = _wing(target)
        if WINGS[mine] == "engine" and theirs != mine:
            wrong.append(
                f"line {line}: the engine imports {target}; it may import only "
                f"itself and {sorted(FOUNDATION)}"
            )
        elif theirs is None and WINGS[mine] != "tools":
            wrong.append(
                f"line {line}: the {WINGS[mine]} wing imports {target} from the top "
                f"of the package, which stands above every wing but tools"
            )
        elif theirs is not None and theirs > mine:
            wrong.append(
                f"line {line}: the {WINGS[mine]} wing imports {target} from the "
                f"{WINGS[theirs]} wing above it (order: {' < '.join(WINGS)})"
            )
    assert not wrong, f"{name}:\n  " + "\n  ".join(wrong)


def _module_of(target: str):
    """The module of mpidp that an imported name lies in (a.b: module a.b, else a)."""
    while target and target not in NAMES:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_circles():
    graph = {}
    for path in MODULES:
        name = _module_name(path)
        graph[name] = {
            m
            for t, _ in _imports(path)
            if t.startswith("mpidp")
            for m in [_module_of(t)]
            if m is not None and m != name
        }
    # A package's face imports its own modules; a module importing its package's face from
    # inside is what would close a circle, and the walk below finds it.
    state, circles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n  " + "\n  ".join(" -> ".join(c) for c in circles)


def _probe(monkeypatch, where, source):
    fake = PACKAGE / where / "_layering_probe.py"
    monkeypatch.setattr(
        pathlib.Path,
        "read_text",
        lambda self, *a, **k: source if self == fake else pathlib.Path.read_bytes(self).decode(),
    )
    with pytest.raises(AssertionError) as info:
        test_imports_point_down(fake)
    return str(info.value)


def test_the_rules_catch_an_engine_module_importing_the_training_layer(monkeypatch):
    said = _probe(
        monkeypatch,
        "engine",
        '"""probe."""\nfrom ..training.optimizer import DistributedOptimizer\nimport mpi4py\n',
    )
    assert "the engine imports mpidp.training.optimizer" in said
    assert "imports mpi4py" in said


@pytest.mark.parametrize(
    "where, source, said",
    [
        (
            "ops",
            "from ..training import buckets",
            "the ops wing imports mpidp.training.buckets from the training wing above it",
        ),
        ("runtime", "from .. import ops", "the runtime wing imports mpidp.ops from the ops wing"),
        ("training", "from .. import checkpoint", "imports mpidp.checkpoint from the top"),
        ("sharded", "from ..state import rng", "the sharded wing imports mpidp.state.rng"),
    ],
)
def test_the_rules_catch_a_wing_importing_one_above_it(monkeypatch, where, source, said):
    assert said in _probe(monkeypatch, where, f'"""probe."""\n{source}\n')
