# stage: reference
# task: gpt2/residual_layernorm
# expect: each epilogue over whole tiles
"""Row statistics folded over acc + bias: right on the real extent, but a ragged tile's
padded columns add the stale bias on the GPU (quack sums every lane)."""
from coda_agent.primitives import (ColVec, RowVec, Tile, col_sum, epilogue, gemm, layernorm_fold,
                                   layernorm_stats)


@epilogue(reductions={"sum": col_sum(), "sumsq": col_sum(), "bias_dot": col_sum()})
def residual_moments(acc, b: RowVec, x: Tile):
    # The sums fold a = acc + x, which is 0 in a ragged tile's padded lanes (b is
    # not); layernorm_stats adds the bias's share.
    a = acc + x
    return {"D": a + b, "sum": a + b, "sumsq": (a + b) * (a + b), "bias_dot": 0.0 * a}


@epilogue()
def ln_rank1(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}


def forward(attn, x, w_o, b_o, gamma, beta, w_fc, b_fc, eps):
    a = gemm(attn, w_o.t(), residual_moments, b=b_o, x=x)
    stats = layernorm_stats(a["sum"], a["sumsq"], x.shape[1], eps)
    fold = layernorm_fold(w_fc.t(), gamma, beta, b_fc)
    y = gemm(a["D"], fold["B"], ln_rank1, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
             shift=fold["c"])["D"]
    return {"h": a["D"], "y": y}
