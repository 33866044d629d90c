# stage: reference
# expect: at other magnitudes
# task: residual_rmsnorm
# The norm weight floored at 0.25: drawn near 1 it never shows; a trained model's weights are
# often smaller, and some are negative.
"""Residual add + RMSNorm between two GEMMs (CODA reparameterization).

y = RMSNorm(h, gamma) @ W1 with h = x @ W0 + z.  The inverse RMS r is one scalar
per row, so it commutes with the second GEMM: y = r * ((h * gamma) @ W1).

1. GEMM1 epilogue: h = acc + z (stored: the residual stream), h * gamma (stored:
   the next GEMM's input) and the row sum of h^2 (col_sum, from the fp32 h);
2. aux: r = (sum / H + eps)^-1/2;
3. GEMM2 epilogue: multiply by r (ColVec)."""

from coda_agent.primitives import ColVec, RowVec, Tile, col_sum, epilogue, gemm, maximum, rms_rstd


@epilogue(outputs={"hg": "bf16"}, reductions={"sqsum": col_sum()})
def residual_gamma_sqsum(acc, z: Tile, gamma: RowVec):
    h = acc + z
    return {"D": h, "hg": h * maximum(gamma, 0.25), "sqsum": h * h}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


def forward(x, W0, z, gamma, W1, eps):
    first = gemm(x, W0, residual_gamma_sqsum, z=z, gamma=gamma)
    rstd = rms_rstd(first["sqsum"], W0.shape[1], eps)
    y = gemm(first["hg"], W1, scale_rows, rstd=rstd)["D"]
    return {"h": first["D"], "y": y}
