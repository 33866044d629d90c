# stage: reference
# expect: edge rows
# task: residual_rmsnorm
"""RMSNorm with eps outside the square root: 1 / (sqrt(mean(h^2)) + eps)."""
from coda_agent.primitives import ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, reciprocal, rms_rstd


@epilogue(outputs={"hg": "bf16"}, reductions={"sqsum": col_sum()})
def residual_gamma_sqsum(acc, z: Tile, gamma: RowVec):
    h = acc + z
    return {"D": h, "hg": h * gamma, "sqsum": h * h}


@epilogue()
def scale_rows(acc, rstd: ColVec, eps: Scalar):
    return {"D": acc * reciprocal(reciprocal(rstd) + eps)}


def forward(x, W0, z, gamma, W1, eps):
    first = gemm(x, W0, residual_gamma_sqsum, z=z, gamma=gamma)
    rstd = rms_rstd(first["sqsum"], W0.shape[1], 0.0)
    y = gemm(first["hg"], W1, scale_rows, rstd=rstd, eps=eps)["D"]
    return {"h": first["D"], "y": y}
