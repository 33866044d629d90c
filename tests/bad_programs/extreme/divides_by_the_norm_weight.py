# stage: reference
# expect: at other magnitudes
# task: rmsnorm_bwd
# The gamma gradient read off x * r * gamma divided by gamma: 0/0 on a channel whose weight is 0
# (pruned, dead or zero-initialised), which no draw held.
"""RMSNorm backward between two GEMMs.  The epilogue forms xrg = x * r * gamma once (the weight
gradient's input) and reads the gamma gradient's per-element term d * x * r off it as
d * xrg / gamma, so x * r is never held next to xrg."""

from coda_agent.primitives import ColVec, RowVec, Scalar, Tile, epilogue, gemm, reciprocal, row_sum


@epilogue(outputs={"xrg": "bf16"}, reductions={"dgamma": row_sum()})
def rmsnorm_dx(acc, r: ColVec, s: ColVec, gamma: RowVec, x: Tile, dres: Tile, inv_dim: Scalar):
    xrg = x * r * gamma
    dx = dres + r * (gamma * acc - x * r * (s * inv_dim))
    return {"D": dx, "xrg": xrg, "dgamma": acc * xrg * reciprocal(gamma)}


def forward(du, W, r, s, gamma, x, dres):
    dim = x.shape[1]
    out = gemm(du, W.t(), rmsnorm_dx, r=r, s=s, gamma=gamma, x=x, dres=dres, inv_dim=1.0 / dim)
    dW = gemm(out["xrg"].t(), du)["D"]
    return {"dx": out["D"], "xrg": out["xrg"], "dgamma": out["dgamma"], "dW": dW}
