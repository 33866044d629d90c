# stage: reference
# expect: with outlier channels || with edge rows
# task: residual_rmsnorm
"""y scaled by 1.25 x the true inverse RMS on rows whose RMS lies between 2 and 20: the fresh
draws' rows have RMS ~1.41 and the fixed edge rows 2^-12 or 2^5 times that, so only the edge rows
scaled between those two (every magnitude, drawn per row) land in the band, as real residual
streams do; and the outlier draw's rows, whose outlier channels raise their RMS into it."""

from coda_agent.primitives import ColVec, RowVec, Tile, col_sum, epilogue, gemm, rms_rstd, where


@epilogue(outputs={"hg": "bf16"}, reductions={"sqsum": col_sum()})
def residual_gamma_sqsum(acc, z: Tile, gamma: RowVec):
    h = acc + z
    return {"D": h, "hg": h * gamma, "sqsum": h * h}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    r = where(rstd > 0.5, rstd, where(rstd < 0.05, rstd, rstd * 1.25))
    return {"D": acc * r}


def forward(x, W0, z, gamma, W1, eps):
    first = gemm(x, W0, residual_gamma_sqsum, z=z, gamma=gamma)
    rstd = rms_rstd(first["sqsum"], W0.shape[1], eps)
    y = gemm(first["hg"], W1, scale_rows, rstd=rstd)["D"]
    return {"h": first["D"], "y": y}
