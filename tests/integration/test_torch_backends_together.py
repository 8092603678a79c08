"""torch.distributed's backend "mpidp" beside a gloo default group and mpidp.torch, one process."""

import pytest

from .launch import SCRIPTS, run


@pytest.mark.timeout(180, method="thread")
def test_gloo_default_an_mpidp_group_and_mpidp_torch_in_one_job():
    n = 3  # odd: the group, DDP and the optimizer's ring and split paths
    res = run(n, SCRIPTS / "backends_together.py", timeout=150)
    assert res.returncode == 0, res.output[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == n and all(line.endswith("ok True") for line in lines), res.output[-3000:]
