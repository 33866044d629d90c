"""Mamba-2's gated RMSNorm into the out projection.  Forward: a tile pass forms g = y * silu(z) in
fp32, writes g * w (the GEMM's A) and folds sum(g^2) per row; the GEMM scales each row by rstd
(RMSNorm(g) * w @ W == rstd * ((g * w) @ W)).  Backward: the norm's gradient projects dn = (dout @ w_out)
* w off the normed n = g * rstd, dg = rstd * (dn - n * sum(dn * n) / I), and where a few outlier
channels carry the row's norm that projection nearly cancels there: the sum must come from the same
dn and n that the subtraction uses.  (The output identity sum(dn * n) = sum(dout * out) reads the
forward's bf16-rounded g * w instead, and misses by 2^-9 of dn in the outlier channels, where the
reference errs by far less.)  So the GEMM dout @ w_out keeps dn in fp32 and folds that sum and w's
gradient from the fp32 n it recomputes; a tile pass then finishes the gate's two gradients, and the
weight gradient is dout^T diag(rstd) @ (g * w), dout scaled in a pass of its own."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, epilogue, gemm, rms_rstd, row_sum, silu,
                                   silu_grad, tile_pass)


@epilogue(reductions={"sqsum": col_sum()})
def gate_stats(y: Tile, z: Tile, w: RowVec):
    g = y * silu(z)
    return {"D": g * w, "sqsum": g * g}


@epilogue()
def scale_rows(acc, rstd: ColVec):
    return {"D": acc * rstd}


@epilogue()
def scale_dout(dout: Tile, rstd: ColVec):
    return {"D": dout * rstd}


@epilogue(reductions={"s": col_sum(), "dw": row_sum()})
def norm_grad_stats(acc, y: Tile, z: Tile, w: RowVec, rstd: ColVec):
    n = y * silu(z) * rstd
    dn = acc * w
    return {"D": dn, "s": dn * n, "dw": acc * n}


@epilogue(outputs={"dz": "bf16"})
def gated_norm_bwd(dn: Tile, y: Tile, z: Tile, rstd: ColVec, s: ColVec, inv_dim: Scalar):
    sz = silu(z)
    g = y * sz
    dg = rstd * (dn - g * rstd * s * inv_dim)
    return {"D": dg * sz, "dz": dg * y * silu_grad(z)}


def forward(y, z, w, w_out, eps):
    g = tile_pass(gate_stats, y=y, z=z, w=w)
    rstd = rms_rstd(g["sqsum"], y.shape[1], eps)
    out = gemm(g["D"], w_out.t(), scale_rows, rstd=rstd)["D"]
    return {"out": out, "gw": g["D"], "rstd": rstd}


def backward(saved, dout):
    rstd = saved["rstd"]
    dw_out = gemm(tile_pass(scale_dout, dout=dout, rstd=rstd)["D"].t(), saved["gw"])["D"]
    st = gemm(dout, saved["w_out"], norm_grad_stats, out_dtype="fp32", y=saved["y"], z=saved["z"], w=saved["w"],
              rstd=rstd)
    d = tile_pass(gated_norm_bwd, out_dtype="bf16", dn=st["D"], y=saved["y"], z=saved["z"], rstd=rstd, s=st["s"],
                  inv_dim=1.0 / saved["y"].shape[1])
    return {"dy": d["D"], "dz": d["dz"], "dw": st["dw"], "dw_out": dw_out}
