"""LayerNorm backward between two GEMMs.

With g = du @ w (the gradient of LN(h)), xhat = (h - mean) * rstd and the row
statistics s1 = sum_cols(gamma * g), s2 = sum_cols(gamma * g * xhat) reduced by
the epilogue that produced du:

    dx = dres + rstd * (gamma * g - (s1 + xhat * s2) / H)
       = dres + rstd * gamma * g + p * h + q,   xhat = rstd * h + r0

r0, p and q are per-row coefficients, computed once per row from the (T,)
statistics (vector_pass) instead of once per element.  The g GEMM's epilogue
reads h and dres as tiles, writes dx and LN(h) = xhat * gamma + beta (the
weight gradient's input) and reduces dgamma = sum_rows(g * xhat) and
dbeta = sum_rows(g); dw = du^T @ LN(h).

Floor: 2 GEMMs; beyond their operands, the reads of h and dres and the LN(h)
store in the first GEMM's epilogue."""

from coda_agent.primitives import ColVec, RowVec, Scalar, Tile, epilogue, gemm, row_sum, vector_pass


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum()})
def ln_backward(acc, h: Tile, dres: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                beta: RowVec):
    xhat = rstd * h + r0
    return {"D": dres + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc}


def forward(du, w, h, mean, rstd, s1, s2, gamma, beta, dres):
    k = vector_pass(ln_grad_coeffs, mean=mean, rstd=rstd, s1=s1, s2=s2, inv_dim=1.0 / h.shape[1])
    d = gemm(du, w, ln_backward, h=h, dres=dres, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"], gamma=gamma,
             beta=beta)
    return {"dx": d["D"], "ln": d["ln"], "dgamma": d["dgamma"], "dbeta": d["dbeta"],
            "dw": gemm(du.t(), d["ln"])["D"]}
