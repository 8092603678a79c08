"""Each public module exports exactly the names docs/api.md lists, and every one of them exists."""

import importlib
import pathlib
import re
import types

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _documented():
    """{module name: set of names} from docs/api.md's `## `module` and `module`` sections."""
    sections, current = {}, []
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = re.findall(r"`([\w.]+)`", line)
            for mod in current:
                sections[mod] = set()
        elif line.startswith("- `") and current:
            name = re.match(r"- `(\w+)`", line).group(1)
            for mod in current:
                sections[mod].add(name)
    return sections


DOCUMENTED = _documented()


def test_the_doc_lists_mpidp_and_every_horovod_submodule():
    assert {
        "mpidp",
        "mpidp.torch",
        "mpidp.torch.compression",
        "mpidp.torch.elastic",
        "mpidp.torch.functions",
        "mpidp.torch.mpi_ops",
        "mpidp.torch.optimizer",
        "mpidp.torch.sync_batch_norm",
        "mpidp.torch.elastic.sampler",
        "mpidp.torch.elastic.state",
        "mpidp.common.exceptions",
    } <= set(DOCUMENTED)


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_all_is_exactly_the_documented_names(module):
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), f"{module}.__all__ repeats a name"
    missing = sorted(DOCUMENTED[module] - exported)
    extra = sorted(exported - DOCUMENTED[module])
    assert not missing and not extra, (
        f"{module}: documented but not exported {missing}; exported but not in docs/api.md {extra}"
    )
    absent = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not absent, f"{module}.__all__ names what it lacks: {absent}"
    modules = [n for n in mod.__all__ if isinstance(getattr(mod, n), types.ModuleType)]
    assert not modules, f"{module}.__all__ exports modules: {modules}"


def test_star_import_of_mpidp_torch_brings_only_the_public_names():
    scope = {}
    exec("from mpidp.torch import *", scope)
    names = {n for n in scope if not n.startswith("__")}
    assert names == DOCUMENTED["mpidp.torch"]


def test_horovod_submodules_are_the_submodules_not_mpidp_modules():
    import mpidp.torch as hvd

    for sub in ("compression", "elastic", "functions", "mpi_ops", "optimizer", "sync_batch_norm"):
        assert getattr(hvd, sub).__name__ == f"mpidp.torch.{sub}"


def test_reduce_ops_are_horovods_integers():
    """Scripts pass and store them as plain integers (horovod/common/basics.py takes them from
    the C enum): op=3 must be Min, as there."""
    hvd = importlib.import_module("mpidp.torch")
    got = [int(getattr(hvd, n)) for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product")]
    assert got == [0, 1, 2, 3, 4, 5]
