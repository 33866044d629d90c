"""The MLP's first GEMM + bias + exact GELU, one GEMM.

The epilogue adds the bias (RowVec) to the fp32 accumulator, stores the
pre-activation as D (saved for the backward) and gelu of it as an extra
output: both tensors the task returns, written once each.

Floor: 1 GEMM; beyond its own output, the second (T, I) store."""

from coda_agent.primitives import RowVec, epilogue, gelu, gemm


@epilogue(outputs={"y": "bf16"})
def bias_gelu(acc, b: RowVec):
    pre = acc + b
    return {"D": pre, "y": gelu(pre)}


def forward(x, w_fc, b_fc):
    out = gemm(x, w_fc.t(), bias_gelu, b=b_fc)
    return {"y": out["y"], "pre": out["D"]}
