# stage: reference
# expect: at other magnitudes
# task: llama3_fp8/swiglu_fwd_fp8
# The raw fp8 accumulator stored in fp16: fp8 operands drawn near 1 never pass 65504; quantized
# by the row-wise recipe they fill the format's range (|q| up to 448) and it overflows.
"""Gate/up GEMM + SwiGLU on fp8 operands, in steps: the plain fp8 GEMM writes the raw
accumulator x_fp8 @ w_fp8^T in fp16 (half the bytes of fp32, more mantissa than bf16), a tile
pass applies both dequantization scales (pre, bf16), and a pass over the (gate, up) pairs the SwiGLU."""

from coda_agent.primitives import ColVec, PairedTile, RowVec, Tile, epilogue, gemm, pack, silu, tile_pass, unpack


@epilogue()
def dequant(raw: Tile, x_scale: ColVec, w_scale: RowVec):
    return {"D": raw * x_scale * w_scale}


@epilogue(outputs={"y": "bf16"})
def swiglu(pre: PairedTile):
    g, u = unpack(pre)
    return {"D": pack(g, u), "y": silu(g) * u}


def forward(x, x_scale, w_gu, w_scale):
    raw = gemm(x, w_gu.t(), out_dtype="fp16", fast_accum=True)["D"]
    pre = tile_pass(dequant, raw=raw, x_scale=x_scale, w_scale=w_scale, out_dtype="bf16")["D"]
    out = tile_pass(swiglu, pre=pre)
    return {"y": out["y"], "pre": out["D"]}
