"""Argument checks in mpidp.ops.op_args that need no engine: devices of grouped ops, split lists."""

import pytest
import torch

from mpidp.ops import op_args


def test_grouped_op_with_two_device_kinds_is_refused_naming_the_odd_tensor():
    tensors = [torch.ones(2), torch.ones(2), torch.ones(2, device="meta")]
    with pytest.raises(ValueError, match=r"tensor 2 is on meta but tensor 0 is on cpu"):
        op_args.same_device(tensors, "grouped_allreduce")
    op_args.same_device(tensors[:2], "grouped_allreduce")  # one kind: accepted


def test_tensor_on_an_unsupported_device_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"is on meta.*host memory and CUDA memory.*\.cpu\(\)"):
        op_args.check_tensor(torch.ones(2, device="meta"), "allreduce 'x'", False)


def test_empty_splits_are_counted_not_called_floats():
    with pytest.raises(ValueError, match="splits has 0 entries but there are 3 ranks"):
        op_args.check_splits([], torch.ones(6), 3, "alltoall 'x'")
