"""torch.distributed's backend "mpidp" beside a gloo default group and mpidp.torch, one process."""

import re

import pytest

from .launch import SCRIPTS, run


@pytest.mark.timeout(180, method="thread")
def test_gloo_default_an_mpidp_group_and_mpidp_torch_in_one_job():
    n = 3  # odd: the group, DDP and the optimizer's ring and split paths
    res = run(n, SCRIPTS / "backends_together.py", timeout=150)
    assert res.returncode == 0, res.output[-3000:]
    # Searched, not split into lines: hydra may join two ranks' lines into one.
    verdicts = dict(re.findall(r"rank (\d+): [^\n]*? ok (True|False)", res.stdout))
    assert verdicts == {str(r): "True" for r in range(n)}, res.output[-3000:]
