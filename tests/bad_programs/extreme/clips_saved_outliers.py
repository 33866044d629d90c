# stage: reference
# expect: outlier channels
# task: rmsnorm_bwd
"""RMSNorm's backward with the saved pre-norm x clipped at 6 times its row's RMS before the
epilogue reads it: a backward sees the hidden state as a saved input, and its outlier channels
are the forward's (the outlier draw makes them outliers in saved tensors too)."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, epilogue, gemm, maximum, minimum, row_stats,
                                   row_sum, tile_pass)


@epilogue()
def clip_rows(x: Tile, mean: ColVec, rstd: ColVec):
    top = 6.0 / rstd
    return {"D": minimum(maximum(x - mean, -top), top) + mean}


@epilogue(outputs={"xrg": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_dx(acc, r: ColVec, s: ColVec, gamma: RowVec, x: Tile, dres: Tile, inv_dim: Scalar):
    xr = x * r
    return {"D": dres + r * (gamma * acc - xr * (s * inv_dim)), "xrg": xr * gamma, "dgamma": acc * xr}


def forward(du, W, r, s, gamma, x, dres):
    stats = row_stats(x, 1e-30)
    clipped = tile_pass(clip_rows, x=x, mean=stats["mean"], rstd=stats["rstd"])["D"]
    out = gemm(du, W.t(), rmsnorm_dx, r=r, s=s, gamma=gamma, x=clipped, dres=dres, inv_dim=1.0 / x.shape[1])
    return {"dx": out["D"], "xrg": out["xrg"], "dgamma": out["dgamma"], "dW": gemm(out["xrg"].t(), du)["D"]}
