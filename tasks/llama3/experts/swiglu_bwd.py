"""Down-projection backward through SwiGLU, one GEMM: dact = dout @ W_down^T.

The epilogue reads the saved interleaved pre-activation as a PairedTile (g, u),
writes (dg, du) interleaved at width 2I, recomputes silu(g) * u (the input of
the W_down gradient GEMM) and folds s = sum(dg * g + du * u) per row, the
statistic of the RMSNorm backward of the norm feeding the gate/up GEMM."""

from coda_agent.primitives import PairedTile, col_sum, epilogue, gemm, pack, sigmoid, unpack


@epilogue(outputs={"postact": "bf16"}, reductions={"s": col_sum()})
def dswiglu(acc, pre: PairedTile):
    g, u = unpack(pre)
    sg = sigmoid(g)
    act = g * sg
    dg = acc * u * sg * (1.0 + g * (1.0 - sg))
    du = acc * act
    return {"D": pack(dg, du), "postact": act * u, "s": dg * g + du * u}


def forward(dout, W_down, pre):
    out = gemm(dout, W_down.t(), dswiglu, pre=pre)
    return {"dpre": out["D"], "postact": out["postact"], "s": out["s"]}
