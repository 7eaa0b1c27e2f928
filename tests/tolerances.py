"""Per-dtype tolerances against a float64 oracle: (atol, rtol) for outputs of unit-scale data.

float32 math is exact to ~1e-6; 16-bit outputs carry one rounding of the output itself (fp16
2^-11, bf16 2^-8 relative) plus the rounding of the probabilities fed to the second matmul.
"""

import torch

ATTN_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float,
                 case: str = "") -> None:
    """Max-abs and relative check that names the case and reports both errors on failure.

    ``-inf`` must match ``-inf`` exactly; NaN never passes.
    """
    got64, want64 = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got64).any(), f"{case} {name}: NaN in output"
    inf_got, inf_want = torch.isinf(got64), torch.isinf(want64)
    assert torch.equal(inf_got, inf_want) and torch.equal(got64[inf_got], want64[inf_want]), (
        f"{case} {name}: infinities differ")
    g, w = got64[~inf_got], want64[~inf_want]
    if g.numel() == 0:
        return
    err = (g - w).abs()
    bound = atol + rtol * w.abs()
    rel = (err.norm() / w.norm().clamp_min(1e-30)).item()
    assert bool((err <= bound).all()), (
        f"{case} {name}: max abs err {err.max().item():.3e} (allowed {atol:.1e} + {rtol:.1e}|x|), "
        f"relative L2 err {rel:.3e}")
