"""Residual add + LayerNorm between two GEMMs (CODA's reparameterization, for
LayerNorm).

y = LN(h) @ w_fc^T + b_fc with h = x + attn @ w_o^T + b_o.  mean and rstd are
one value per row, so LN commutes with the second GEMM in its rank-1 form
y = rstd * (h @ (w_fc * gamma)^T - mean * gw) + c:

1. GEMM1 epilogue: h = acc + b_o + x (stored: the residual stream) and the row
   sums of a = acc + x, a^2 and a * b_o (col_sum, fp32; a, not h, is 0 in a
   ragged tile's padded lanes);
2. aux: mean and rstd from the sums (layernorm_stats); the folded weight, its
   column sums gw and c = beta @ w_fc^T + b_fc (layernorm_fold);
3. GEMM2 reads the stored h; its epilogue finishes rstd * (acc - mean * gw) + c.

Floor: 2 GEMMs; beyond their operands, the residual read in GEMM1's epilogue
and two passes over w_fc (the normalized h is never written)."""

from coda_agent.primitives import (ColVec, RowVec, Tile, col_sum, epilogue, gemm, layernorm_fold,
                                   layernorm_stats)


@epilogue(reductions={"sum": col_sum(), "sumsq": col_sum(), "bias_dot": col_sum()})
def residual_moments(acc, b: RowVec, x: Tile):
    # The sums fold a = acc + x, which is 0 in a ragged tile's padded lanes (b is
    # not); layernorm_stats adds the bias's share.
    a = acc + x
    return {"D": a + b, "sum": a, "sumsq": a * a, "bias_dot": a * b}


@epilogue()
def ln_rank1(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}


def forward(attn, x, w_o, b_o, gamma, beta, w_fc, b_fc, eps):
    a = gemm(attn, w_o.t(), residual_moments, b=b_o, x=x)
    stats = layernorm_stats(a["sum"], a["sumsq"], x.shape[1], eps, bias=b_o, bias_dot=a["bias_dot"])
    fold = layernorm_fold(w_fc.t(), gamma, beta, b_fc)
    y = gemm(a["D"], fold["B"], ln_rank1, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
             shift=fold["c"])["D"]
    return {"h": a["D"], "y": y}
