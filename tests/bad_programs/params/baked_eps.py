# stage: reference
# expect: with params eps=
# task: residual_rmsnorm
# The task's eps written into the program instead of read from the call: right at the value the
# task file states, wrong at the judge's varied one on the rows where eps matters (tiny norms).
"""Residual add + RMSNorm between two GEMMs, with eps typed in."""

from coda_agent.primitives import ColVec, RowVec, Tile, col_sum, epilogue, gemm, rms_rstd

EPS = 1e-5


@epilogue(outputs={"hg": "bf16"}, reductions={"sqsum": col_sum()})
def residual_gamma_sqsum(acc, z: Tile, gamma: RowVec):
    h = acc + z
    return {"D": h, "hg": h * gamma, "sqsum": h * h}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


def forward(x, W0, z, gamma, W1, eps):
    first = gemm(x, W0, residual_gamma_sqsum, z=z, gamma=gamma)
    rstd = rms_rstd(first["sqsum"], W0.shape[1], EPS)
    y = gemm(first["hg"], W1, scale_rows, rstd=rstd)["D"]
    return {"h": first["D"], "y": y}
