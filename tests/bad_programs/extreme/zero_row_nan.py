# stage: reference
# expect: between and 0
# task: residual_rmsnorm
# The inverse RMS relative to the row's largest |h|: 0/0 on a row that is exactly zero (a padding
# token's), which no draw held until edge rows included zeros.
"""Residual add + RMSNorm between two GEMMs, with an overflow-safe inverse RMS.

The sum of squares is folded relative to the row's largest magnitude m (col_max of |h|):
r = 1 / (m * sqrt(sum((h/m)^2) / H + eps / m^2)), which never overflows fp32 for huge rows."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_max, col_sum, epilogue, gemm, maximum,
                                   reciprocal, rsqrt, vector_pass)


@epilogue(outputs={"hg": "bf16"}, reductions={"sqsum": col_sum(), "amax": col_max()})
def residual_gamma_sqsum(acc, z: Tile, gamma: RowVec):
    h = acc + z
    return {"D": h, "hg": h * gamma, "sqsum": h * h, "amax": maximum(h, 0.0 - h)}


@epilogue()
def safe_rstd(sqsum: ColVec, amax: ColVec, inv_dim: Scalar, eps: Scalar):
    inv_m = reciprocal(amax)
    return {"D": inv_m * rsqrt(sqsum * inv_m * inv_m * inv_dim + eps * inv_m * inv_m)}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


def forward(x, W0, z, gamma, W1, eps):
    first = gemm(x, W0, residual_gamma_sqsum, z=z, gamma=gamma)
    rstd = vector_pass(safe_rstd, sqsum=first["sqsum"], amax=first["amax"], inv_dim=1.0 / W0.shape[1], eps=eps)["D"]
    y = gemm(first["hg"], W1, scale_rows, rstd=rstd)["D"]
    return {"h": first["D"], "y": y}
