"""Gemma MLP: y = h + W_down(gelu_tanh(g) * u), (g, u) = rstd * ((h * (1 + w)) @ W_gu^T)."""
from coda_agent.primitives import (ColVec, PairedTile, RowVec, Scalar, Tile, col_sum, epilogue, gemm, pack,
                                   rms_rstd, row_sum, tanh_fast, tile_pass, unpack)

C = 0.7978845608028654  # sqrt(2 / pi)
A3 = 0.044715


@epilogue(reductions={"sq": col_sum()})
def scale_prep(h: Tile, w: RowVec):
    return {"D": h * (1.0 + w), "sq": h * h}


@epilogue(outputs={"act": "bf16"}, pairs="acc")
def norm_geglu(acc, rstd: ColVec):
    g, u = unpack(acc)
    g = g * rstd
    u = u * rstd
    t = tanh_fast(C * (g + A3 * g * g * g))
    return {"D": pack(g, u), "act": 0.5 * g * (1.0 + t) * u}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue(outputs={"act": "bf16"}, reductions={"s": col_sum()})
def dgeglu(acc, pre: PairedTile, rstd: ColVec):
    g, u = unpack(pre)
    t = tanh_fast(C * (g + A3 * g * g * g))
    gl = 0.5 * g * (1.0 + t)
    dgl = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * C * (1.0 + 3.0 * A3 * g * g)
    dg = acc * u * dgl
    du = acc * gl
    return {"D": pack(dg * rstd, du * rstd), "act": gl * u, "s": g * dg + u * du}


@epilogue()
def scale_cols(acc, w: RowVec):
    return {"D": acc * (1.0 + w)}


@epilogue(reductions={"dw": row_sum()})
def rmsnorm_bwd(acc, rstd: ColVec, s: ColVec, w: RowVec, h: Tile, dy: Tile, inv_dim: Scalar):
    return {"D": dy + (1.0 + w) * acc - h * rstd * rstd * s * inv_dim, "dw": acc * h}


def forward(h, w_norm, w_gu, w_down, eps):
    prep = tile_pass(scale_prep, h=h, w=w_norm)
    rstd = rms_rstd(prep["sq"], h.shape[1], eps)
    gu = gemm(prep["D"], w_gu.t(), norm_geglu, rstd=rstd)
    y = gemm(gu["act"], w_down.t(), add_residual, residual=h)["D"]
    return {"y": y, "pre": gu["D"], "rstd": rstd}


def backward(saved, dy):
    h, w, rstd = saved["h"], saved["w_norm"], saved["rstd"]
    da = gemm(dy, saved["w_down"], dgeglu, pre=saved["pre"], rstd=rstd, out=saved["pre"])
    dw_down = gemm(dy.t(), da["act"])["D"]
    d = gemm(da["D"], saved["w_gu"], rmsnorm_bwd, rstd=rstd, s=da["s"], w=w, h=h, dy=dy,
             inv_dim=1.0 / h.shape[1])
    dw_gu = gemm(da["D"].t(), h, scale_cols, w=w)["D"]
    return {"dh": d["D"], "dw_norm": d["dw"], "dw_gu": dw_gu, "dw_down": dw_down}
