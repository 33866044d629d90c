"""RMSNorm backward between two GEMMs (CODA-MATH "RMSNorm backward").

The GEMM d = du @ W^T has an epilogue that loads r and s (ColVec), gamma
(RowVec), the saved pre-norm x and the incoming residual gradient dres (Tiles),
and writes dx = dres + r * (gamma * d - (x * r) * s / dim), x * r * gamma (the
weight-gradient GEMM's input) and the gamma gradient sum_rows(d * x * r).
A second GEMM gives dW = (x * r * gamma)^T @ du."""

from coda_agent.primitives import ColVec, RowVec, Scalar, Tile, epilogue, gemm, row_sum


@epilogue(outputs={"xrg": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_dx(acc, r: ColVec, s: ColVec, gamma: RowVec, x: Tile, dres: Tile, inv_dim: Scalar):
    xr = x * r
    dx = dres + r * (gamma * acc - xr * (s * inv_dim))
    return {"D": dx, "xrg": xr * gamma, "dgamma": acc * xr}


def forward(du, W, r, s, gamma, x, dres):
    dim = x.shape[1]
    out = gemm(du, W.t(), rmsnorm_dx, r=r, s=s, gamma=gamma, x=x, dres=dres, inv_dim=1.0 / dim)
    dW = gemm(out["xrg"].t(), du)["D"]
    return {"dx": out["D"], "xrg": out["xrg"], "dgamma": out["dgamma"], "dW": dW}
