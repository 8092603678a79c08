"""torch.distributed over backend "mpidp", launched for real under mpiexec: the calls real clients
make (DDP, FSDP2 and its distributed checkpoint, Lightning, Accelerate) and their examples in
examples/torch_distributed/.

Each launch pays the start-up of 1-3 Python processes importing torch (several seconds on a
loaded machine; Lightning's import adds a few more), so every run trains for only an epoch or two.
"""

import re

import pytest

from .launch import ROOT, SCRIPTS, run

EXAMPLES = ROOT / "examples" / "torch_distributed"
FLOAT = r"([0-9]+\.[0-9]+)"
LAUNCH_S = 180
pytestmark = pytest.mark.timeout(2 * LAUNCH_S + 60)


def _trained(res, label: str, n: int):
    """The example's last line: the loss fell, on n ranks."""
    assert res.returncode == 0, res.output
    line = rf"{re.escape(label)}: loss {FLOAT} -> {FLOAT} on {n} rank\(s\)"
    # Searched in the whole output, not matched per line: hydra may join two ranks' lines.
    (m,) = re.finditer(line, res.stdout)
    assert float(m.group(2)) < float(m.group(1)), res.stdout
    return res.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_example(n):
    _trained(run(n, EXAMPLES / "ddp.py", "--epochs", 2, timeout=LAUNCH_S), "ddp", n)


def test_fsdp2_checkpoint_saved_at_two_loads_at_three(tmp_path):
    ckpt = tmp_path / "dcp"
    saved = _trained(
        run(2, EXAMPLES / "fsdp2.py", "--epochs", 2, "--save", ckpt, timeout=LAUNCH_S), "fsdp2", 2
    )
    (saved_sum,) = re.findall(rf"saved {re.escape(str(ckpt))}: params ([0-9a-f]{{16}})", saved)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ], saved

    loaded = _trained(
        run(3, EXAMPLES / "fsdp2.py", "--epochs", 1, "--load", ckpt, timeout=LAUNCH_S), "fsdp2", 3
    )
    (loaded_sum,) = re.findall(rf"loaded {re.escape(str(ckpt))}: params ([0-9a-f]{{16}})", loaded)
    # The full parameters, gathered from 3 shards, are bit for bit those 2 shards saved.
    assert loaded_sum == saved_sum, (saved, loaded)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fsdp2_matches_one_process(n):
    res = run(n, SCRIPTS / "fsdp2_vs_one.py", 4, timeout=LAUNCH_S)
    assert res.returncode == 0, res.output
    (m,) = re.findall(
        rf"fsdp2 vs one process after 4 steps: max \|diff\| (\S+), moved (\S+) "
        rf"on {n} rank\(s\)",
        res.stdout,
    )
    assert float(m[0]) <= 1e-5 and float(m[1]) > 1e-2, res.stdout


def test_lightning_example():
    res = run(2, EXAMPLES / "lightning_ddp.py", "--epochs", 2, timeout=LAUNCH_S)
    _trained(res, "lightning_ddp", 2)
    assert "distributed_backend=mpidp" in res.output, res.output
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in res.output, res.output


def test_accelerate_example():
    # Accelerate finds the world in hydra's PMI_* variables and picks "mpi", mpidp's.
    _trained(
        run(2, EXAMPLES / "accelerate_train.py", "--epochs", 2, timeout=LAUNCH_S),
        "accelerate (MULTI_CPU, backend mpi)",
        2,
    )
