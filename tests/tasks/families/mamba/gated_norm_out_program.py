"""Mamba-2's gated RMSNorm into the out projection.  Forward: a tile pass forms g = y * silu(z) in
fp32, writes g * w (the GEMM's A) and folds sum(g^2) per row; the GEMM scales each row by rstd
(RMSNorm(g) * w @ W == rstd * ((g * w) @ W)).  Backward: the norm's row statistic
sum(dn * g) = S / rstd, with S = sum(dout * out) read off the output and its gradient in a tile pass
that also scales dout by rstd for the weight gradient (dout^T diag(rstd) @ (g * w)); the GEMM
dout @ w_out finishes dg = rstd * dn - g * rstd^2 * S / I and the gate's two gradients in its
epilogue, and folds dw down the rows."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, rms_rstd, row_sum, silu,
                                   silu_grad, tile_pass)


@epilogue(reductions={"sqsum": col_sum()})
def gate_stats(y: Tile, z: Tile, w: RowVec):
    g = y * silu(z)
    return {"D": g * w, "sqsum": g * g}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


@epilogue(reductions={"s": col_sum()})
def out_stats(dout: Tile, y_out: Tile, rstd: ColVec):
    return {"D": dout * rstd, "s": dout * y_out}


@epilogue(outputs={"dz": "bf16"}, reductions={"dw": row_sum()})
def gated_norm_bwd(acc, y: Tile, z: Tile, w: RowVec, rstd: ColVec, s: ColVec, inv_dim: Scalar):
    sz = silu(z)
    g = y * sz
    dg = rstd * acc * w - g * rstd * rstd * s * inv_dim
    return {"D": dg * sz, "dz": dg * y * silu_grad(z), "dw": acc * g * rstd}


def forward(y, z, w, w_out, eps):
    g = tile_pass(gate_stats, y=y, z=z, w=w)
    rstd = rms_rstd(g["sqsum"], y.shape[1], eps)
    out = gemm(g["D"], w_out.t(), scale_rows, rstd=rstd)["D"]
    return {"out": out, "gw": g["D"], "rstd": rstd}


def backward(saved, dout):
    rstd = saved["rstd"]
    st = tile_pass(out_stats, dout=dout, y_out=saved["out"], rstd=rstd)
    dw_out = gemm(st["D"].t(), saved["gw"])["D"]
    d = gemm(dout, saved["w_out"], gated_norm_bwd, y=saved["y"], z=saved["z"], w=saved["w"], rstd=rstd,
             s=st["s"], inv_dim=1.0 / saved["y"].shape[1])
    return {"dy": d["D"], "dz": d["dz"], "dw": d["dw"], "dw_out": dw_out}
