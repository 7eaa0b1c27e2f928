"""Head dim 512 (FlashInfer and SGLang test it): every op against its oracle at D 512 on small
shapes, through the kernels (and the references, which have no head-dim limit)."""

from __future__ import annotations

import pytest
import torch

import kvops
from tests import test_elastic_attention as te
from tests import test_far_view_summarize as tf
from tests import test_static_sliding_attention as ts


@pytest.mark.parametrize("C", [0, 2])
def test_static_sliding_d512(kernel_device, C):
    dims = (2, 40, 1, 2, 512, C, torch.bfloat16)
    case = ts.make_case(*dims, device=kernel_device, seed=5)
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.static_sliding_attention(**case)
    ts.check_against_oracle(out, lse, case, dims[-1], ts.case_id(*dims))


@pytest.mark.parametrize("path", ["native", "structured"])
def test_elastic_d512(kernel_device, path):
    dims = (2, 3, 16, 1, 2, 512, torch.float16, path)
    case = te.make_case(*dims, device=kernel_device, seed=6)
    with kvops.backend("triton"):
        out, lse = torch.ops.kvops.elastic_attention(**case)
    te.check_against_oracle(out, lse, case, te.case_id(*dims))


def test_far_view_summarize_d512(kernel_device):
    dims = (1, 2, 2, 8, 1, 512, torch.float16)
    case = tf.make_case(*dims, device=kernel_device, seed=7)
    with kvops.backend("triton"):
        k_sum, v_sum = torch.ops.kvops.far_view_summarize(**case)
    tf.check_against_oracle(k_sum, v_sum, case, dims[-1], tf.case_id(*dims))
