"""BERT post-LN: y = LN(z), z = x + h @ w^T + b.

Forward: the GEMM's epilogue writes z and folds the statistics of a = acc + x
(sum a, sum a^2, sum a * b: the bias is not 0 in padded lanes), then
normalize_rows writes y.  Backward: one tile pass over dy and z folds
s1 = sum(gamma dy), s2 = sum(gamma dy xhat) per row and dgamma, dbeta per
column; a second pass writes dz = rstd (gamma dy - (s1 + xhat s2) / H) and
db; then dh = dz @ w and dw = dz^T @ h."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, layernorm_stats,
                                   normalize_rows, row_sum, tile_pass)


@epilogue(outputs={}, reductions={"s": col_sum(), "sq": col_sum(), "sb": col_sum()})
def residual_stats(acc, x: Tile, b: RowVec):
    a = acc + x
    return {"D": a + b, "s": a, "sq": a * a, "sb": a * b}


@epilogue(reductions={"s1": col_sum(), "s2": col_sum(), "dgamma": row_sum(), "dbeta": row_sum()})
def ln_bwd_stats(dy: Tile, z: Tile, mean: ColVec, rstd: ColVec, gamma: RowVec):
    xhat = (z - mean) * rstd
    g = gamma * dy
    return {"s1": g, "s2": g * xhat, "dgamma": dy * xhat, "dbeta": dy}


@epilogue()
def ln_bwd(dy: Tile, z: Tile, mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, gamma: RowVec,
           inv_dim: Scalar):
    xhat = (z - mean) * rstd
    dz = rstd * (gamma * dy - (s1 + xhat * s2) * inv_dim)
    return {"D": dz}


# dz has a per-row constant term, which padded rows (where vectors are not 0) would add to a
# row_sum in ln_bwd: its column sums take a pass over the stored dz, whose padded lanes load 0.
@epilogue(reductions={"db": row_sum()})
def col_sums(dz: Tile):
    return {"db": dz}


def forward(h, x, w, b, gamma, beta, eps):
    r = gemm(h, w.t(), residual_stats, x=x, b=b)
    st = layernorm_stats(r["s"], r["sq"], w.shape[0], eps, bias=b, bias_dot=r["sb"])
    y = normalize_rows(r["D"], st["rstd"], gamma, st["mean"], beta)
    return {"y": y, "z": r["D"], "mean": st["mean"], "rstd": st["rstd"]}


def backward(saved, dy):
    z, mean, rstd, gamma = saved["z"], saved["mean"], saved["rstd"], saved["gamma"]
    st = tile_pass(ln_bwd_stats, dy=dy, z=z, mean=mean, rstd=rstd, gamma=gamma)
    d = tile_pass(ln_bwd, dy=dy, z=z, mean=mean, rstd=rstd, s1=st["s1"], s2=st["s2"], gamma=gamma,
                  inv_dim=1.0 / z.shape[1])
    dz = d["D"]
    db = tile_pass(col_sums, dz=dz)["db"]
    return {"dh": gemm(dz, saved["w"])["D"], "dx": dz, "dw": gemm(dz.t(), saved["h"])["D"], "db": db,
            "dgamma": st["dgamma"], "dbeta": st["dbeta"]}
