# stage: reference
# expect: at other magnitudes
# task: llama3_fp8/swiglu_fwd_fp8
# The weight's dequantization scale floored at 0.5: drawn near 1 it never shows; real scales are
# amax / 448, far below it.
"""Gate/up GEMM + SwiGLU on fp8 operands.

The accumulator is x_fp8 @ w_fp8^T; both dequantization scales are constant
along K, so the epilogue applies them (x's per row, a ColVec; w's per output
column, a RowVec, seen as the pair's two lanes) before the SwiGLU.  The
forward GEMM runs with fast accumulation, as torchao's recipes do."""

from coda_agent.primitives import ColVec, RowVec, epilogue, gemm, maximum, pack, silu, unpack


@epilogue(outputs={"y": "bf16"}, pairs="acc")
def swiglu_scaled(acc, x_scale: ColVec, w_scale: RowVec):
    g, u = unpack(acc * x_scale * maximum(w_scale, 0.5))
    return {"D": pack(g, u), "y": silu(g) * u}


def forward(x, x_scale, w_gu, w_scale):
    out = gemm(x, w_gu.t(), swiglu_scaled, x_scale=x_scale, w_scale=w_scale, fast_accum=True)
    return {"y": out["y"], "pre": out["D"]}
