# stage: reference
# expect: outlier channels
# task: gpt2/mlp_block
"""GPT-2's MLP block with its input clipped at 6 times the row's RMS before the LayerNorm's
GEMM (a guard against overflow, or outliers cut for a narrower format): no draw that scales
whole rows or tensors puts an element there, but a trained model's outlier features and
massive activations are 20 to 1000 times it, and the outlier draw's channels are 8 to 64."""

from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, erf, exp, gelu, gemm,
                                   layernorm_fold, maximum, minimum, row_stats, row_sum, tile_pass, vector_pass)

SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)


@epilogue(outputs={"act": "bf16"})
def ln_fc_gelu(acc, mean: ColVec, rstd: ColVec, gw: RowVec, shift: RowVec):
    pre = rstd * (acc - mean * gw) + shift
    return {"D": pre, "act": gelu(pre)}


@epilogue()
def bias_residual(acc, b: RowVec, x: Tile):
    return {"D": acc + b + x}


@epilogue(reductions={"db": row_sum(), "s1": col_sum(), "s2": col_sum()})
def dgelu_stats(acc, pre: Tile, gw: RowVec, shift: RowVec):
    dpre = acc * (0.5 * (1.0 + erf(pre * SQRT_HALF)) + pre * exp(-0.5 * pre * pre) * INV_SQRT_2PI)
    return {"D": dpre, "db": dpre, "s1": dpre * gw, "s2": dpre * (pre - shift)}


@epilogue(outputs={"r0": "fp32", "p": "fp32", "q": "fp32"})
def ln_grad_coeffs(mean: ColVec, rstd: ColVec, s1: ColVec, s2: ColVec, inv_dim: Scalar):
    # xhat = rstd * h + r0;  dh = dy + rstd * gamma * g + p * h + q
    a = rstd * inv_dim
    return {"r0": -rstd * mean, "p": -a * rstd * s2, "q": a * (rstd * mean * s2 - s1)}


@epilogue(outputs={"ln": "bf16"}, reductions={"dgamma": row_sum(), "dbeta": row_sum(), "db_res": row_sum()})
def ln_backward(acc, h: Tile, dy: Tile, rstd: ColVec, r0: ColVec, p: ColVec, q: ColVec, gamma: RowVec,
                beta: RowVec):
    xhat = rstd * h + r0
    return {"D": dy + rstd * gamma * acc + p * h + q, "ln": xhat * gamma + beta, "dgamma": acc * xhat,
            "dbeta": acc, "db_res": dy}


@epilogue()
def clip_rows(x: Tile, mean: ColVec, rstd: ColVec):
    top = 6.0 / rstd
    return {"D": minimum(maximum(x - mean, -top), top) + mean}


def forward(h, gamma, beta, w_fc, b_fc, w_proj, b_proj, eps):
    stats = row_stats(h, eps)
    fold = layernorm_fold(w_fc.t(), gamma, beta, b_fc)
    clipped = tile_pass(clip_rows, x=h, mean=stats["mean"], rstd=stats["rstd"])["D"]
    fc = gemm(clipped, fold["B"], ln_fc_gelu, mean=stats["mean"], rstd=stats["rstd"], gw=fold["gw"],
              shift=fold["c"])
    y = gemm(fc["act"], w_proj.t(), bias_residual, b=b_proj, x=h)["D"]
    return {"y": y, "pre": fc["D"], "act": fc["act"], "mean": stats["mean"], "rstd": stats["rstd"],
            "gw": fold["gw"], "shift": fold["c"]}


def backward(saved, dy, needs):
    h, rstd = saved["h"], saved["rstd"]
    # dpre goes over the saved pre it is computed from (read before written, not read again).
    da = gemm(dy, saved["w_proj"], dgelu_stats, pre=saved["pre"], out=saved["pre"], gw=saved["gw"],
              shift=saved["shift"])
    k = vector_pass(ln_grad_coeffs, mean=saved["mean"], rstd=rstd, s1=da["s1"], s2=da["s2"],
                    inv_dim=1.0 / h.shape[1])
    d = gemm(da["D"], saved["w_fc"], ln_backward, h=h, dy=dy, rstd=rstd, r0=k["r0"], p=k["p"], q=k["q"],
             gamma=saved["gamma"], beta=saved["beta"])
    grads = {"dh": d["D"], "dgamma": d["dgamma"], "dbeta": d["dbeta"], "db_fc": da["db"], "db_proj": d["db_res"]}
    # a frozen weight (LoRA, a frozen base: not in needs) skips its gradient GEMM
    if "dw_fc" in needs:
        grads["dw_fc"] = gemm(da["D"].t(), d["ln"])["D"]
    if "dw_proj" in needs:
        grads["dw_proj"] = gemm(dy.t(), saved["act"])["D"]
    return grads
