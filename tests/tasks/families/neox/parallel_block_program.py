"""Parallel-residual block (GPT-J, Phi-2), the non-attention part: ln = LN(x) shared by both
branches, out = x + attn @ w_o^T + b_o + gelu_tanh(ln @ w_1^T + b_1) @ w_2^T + b_2.

Forward: row_stats and normalize_rows write ln (an output: the QKV projection reads it, and fc1
here); fc1's epilogue adds b_1 and writes gelu_tanh; the output projection's epilogue adds b_o
and the residual; fc2's adds b_2 and that sum.  Backward: dattn and dw_o from dout; dout @ w_2
with dGELU over the saved pre-activation (and db_1); the LayerNorm's gradient g = dpre @ w_1 + dln
(the two branches meet in the shared LayerNorm) with s1 = sum(gamma g), s2 = sum(gamma g xhat)
in that GEMM's epilogue; a tile pass finishes dx = dout + rstd (gamma g - (s1 + xhat s2) / H),
dgamma, dbeta and the bias gradient both branches share, db_o = db_2 = the column sums of dout."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gelu_tanh, gelu_tanh_grad,
                                   gemm, normalize_rows, row_stats, row_sum, tile_pass)


@epilogue(outputs={"act": "bf16"})
def bias_gelu(acc, b: RowVec):
    pre = acc + b
    return {"D": pre, "act": gelu_tanh(pre)}


@epilogue()
def bias_residual(acc, b: RowVec, r: Tile):
    return {"D": acc + b + r}


@epilogue(reductions={"db": row_sum()})
def dgelu(acc, pre: Tile):
    dpre = acc * gelu_tanh_grad(pre)
    return {"D": dpre, "db": dpre}


@epilogue(reductions={"s1": col_sum(), "s2": col_sum()})
def ln_grad_stats(acc, dln: Tile, x: Tile, mean: ColVec, rstd: ColVec, gamma: RowVec):
    g = acc + dln
    gg = gamma * g
    return {"D": g, "s1": gg, "s2": gg * (x - mean) * rstd}


# the two biases get the same gradient; a result must be a tensor of its own, so it is folded twice
@epilogue(reductions={"dgamma": row_sum(), "dbeta": row_sum(), "db_o": row_sum(), "db_2": row_sum()})
def ln_bwd(g: Tile, x: Tile, dout: Tile, mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, gamma: RowVec,
           inv_dim: Scalar):
    xhat = (x - mean) * rstd
    return {"D": dout + rstd * (gamma * g - (s1 + xhat * s2) * inv_dim), "dgamma": g * xhat, "dbeta": g,
            "db_o": dout, "db_2": dout}


def forward(x, attn, gamma, beta, w_o, b_o, w_1, b_1, w_2, b_2, eps):
    st = row_stats(x, eps)
    ln = normalize_rows(x, st["rstd"], gamma, st["mean"], beta)
    fc = gemm(ln, w_1.t(), bias_gelu, b=b_1)
    y = gemm(attn, w_o.t(), bias_residual, b=b_o, r=x)["D"]
    out = gemm(fc["act"], w_2.t(), bias_residual, b=b_2, r=y)["D"]
    return {"out": out, "ln": ln, "pre": fc["D"], "act": fc["act"], "mean": st["mean"], "rstd": st["rstd"]}


def backward(saved, dout, dln):
    x, mean, rstd, gamma = saved["x"], saved["mean"], saved["rstd"], saved["gamma"]
    dattn = gemm(dout, saved["w_o"])["D"]
    dw_o = gemm(dout.t(), saved["attn"])["D"]
    dw_2 = gemm(dout.t(), saved["act"])["D"]
    da = gemm(dout, saved["w_2"], dgelu, pre=saved["pre"], out=saved["pre"])
    dw_1 = gemm(da["D"].t(), saved["ln"])["D"]
    st = gemm(da["D"], saved["w_1"], ln_grad_stats, dln=dln, x=x, mean=mean, rstd=rstd, gamma=gamma)
    d = tile_pass(ln_bwd, g=st["D"], x=x, dout=dout, mean=mean, rstd=rstd, s1=st["s1"], s2=st["s2"], gamma=gamma,
                  inv_dim=1.0 / x.shape[1])
    return {"dx": d["D"], "dattn": dattn, "dgamma": d["dgamma"], "dbeta": d["dbeta"], "dw_o": dw_o,
            "db_o": d["db_o"], "dw_1": dw_1, "db_1": da["db"], "dw_2": dw_2, "db_2": d["db_2"]}
