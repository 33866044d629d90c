"""OLMo's non-parametric LayerNorm into the QKV projection, in LayerNorm's rank-1 form:
LN(x) @ w^T = rstd * (x @ w^T - mean * gw) with gw the column sums of w^T (layernorm_fold without
gamma and beta: the weight as it is, its column sums, and a zero shift).  The GEMM reads x itself;
row_stats reads x once for mean and rstd, which are outputs of their own (fp32)."""
from coda_agent.primitives import ColVec, RowVec, epilogue, gemm, layernorm_fold, row_stats


@epilogue()
def centred(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    return {"D": rstd * (acc - mean * gw) + shift}


def forward(x, w_qkv, eps):
    stats = row_stats(x, eps)
    fold = layernorm_fold(w_qkv.t(), None, None)
    qkv = gemm(x, fold["B"], centred, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"], shift=fold["c"])
    return {"qkv": qkv["D"], "mean": stats["mean"], "rstd": stats["rstd"]}
