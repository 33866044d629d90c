"""Down-projection backward through SwiGLU on fp8 operands, one GEMM.

dact = (dout_e5m2 @ w_down_e4m3^T) * dout_scale * w_scale: the scales (per row
of dout, a ColVec; per row of w_down = per output column, a RowVec) are applied
to the fp32 accumulator, then the dSwiGLU epilogue of swiglu_bwd reads the
saved pre-activation as a PairedTile, writes (dg, du) interleaved, recomputes
silu(g) * u and folds s = sum(dg * g + du * u) per row.  A gradient GEMM
promotes its partial sums to fp32 (no fast accumulation), as torchao's do."""

from coda_agent.primitives import ColVec, PairedTile, RowVec, col_sum, epilogue, gemm, pack, sigmoid, unpack


@epilogue(outputs={"postact": "bf16"}, reductions={"s": col_sum()})
def dswiglu_scaled(acc, pre: PairedTile, dout_scale: ColVec, w_scale: RowVec):
    dact = acc * dout_scale * w_scale
    g, u = unpack(pre)
    sg = sigmoid(g)
    act = g * sg
    dg = dact * u * sg * (1.0 + g * (1.0 - sg))
    du = dact * act
    return {"D": pack(dg, du), "postact": act * u, "s": dg * g + du * u}


def forward(dout, dout_scale, w_down, w_scale, pre):
    out = gemm(dout, w_down.t(), dswiglu_scaled, pre=pre, dout_scale=dout_scale, w_scale=w_scale)
    return {"dpre": out["D"], "postact": out["postact"], "s": out["s"]}
