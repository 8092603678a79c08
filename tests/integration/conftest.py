"""Integration tests launch real jobs: after each, remove the shared memory killed jobs leave.

Under `--dist loadgroup` (tests/run_suite.sh), the tests marked `xdist_group(name)` (the test
clusters' tests: Slurm daemons, namespace hosts) must run on one pytest-xdist worker, in turn:
each cluster holds a machine-wide lock from its module's first test to its last, so a cluster
test sent to the other worker waits for that lock (234 s of one worker's time in one run).
pytest-xdist groups them by the suffix `@name` it appends to their node ids, writing it to
`item._nodeid`; pytest 9 keeps the node id elsewhere (`item._id`), so the suffix never reached
the ids and the group's tests went to both workers. The hook below appends it where pytest
reads it, when pytest-xdist's own has not arrived.
"""

import pytest

from .launch import clean_shm, shm_files


@pytest.fixture(autouse=True)
def _no_leftover_shm():
    before = shm_files()
    yield
    clean_shm(before)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not config.getoption("loadgroup", False):
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
        if not names:
            continue
        suffix = "@" + "_".join(sorted(names))
        if item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
            continue  # pytest-xdist's own suffix took (pytest before 9)
        try:
            from _pytest.nodeid import coerce_node_id
        except ImportError:  # another pytest: the tests still pass, the clusters' lock waits
            return
        item._id = coerce_node_id(item.nodeid + suffix)
