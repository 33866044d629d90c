"""A linear with bias and exact GELU, forward and backward, in three GEMMs.

Forward: one GEMM; the epilogue adds the bias, stores gelu(pre) as D and
keeps pre (what autograd would save for the backward).  Backward: dy arrives
for the activation from outside, so no epilogue produces it and dGELU needs a
pass of its own: a tile pass without a GEMM reads dy and pre, writes
dpre = dy * gelu'(pre) and folds the bias gradient sum_rows(dpre); then
dx = dpre @ w and dw = dpre^T @ x.  (Hosting the dGELU in an epilogue would
take a GEMM that produces dy: recomputing the forward, a fourth GEMM.)

Floor: 3 GEMMs; beyond their operands and outputs, the pre store in the
forward and the pass (read dy and pre; its dpre write is the dx GEMM's input).
dpre is written over the saved pre it is computed from (each element is read
before it is written, and nothing reads pre afterwards), so the backward holds
no second (T, I) tensor: torch.compile's peak, not 1.4x it."""

from coda_agent.primitives import RowVec, Tile, epilogue, erf, exp, gelu, gemm, row_sum, tile_pass

SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)


@epilogue(outputs={"pre": "bf16"})
def bias_gelu(acc, b: RowVec):
    pre = acc + b
    return {"D": gelu(pre), "pre": pre}


@epilogue(reductions={"db": row_sum()})
def dgelu(dy: Tile, pre: Tile):
    dpre = dy * (0.5 * (1.0 + erf(pre * SQRT_HALF)) + pre * exp(-0.5 * pre * pre) * INV_SQRT_2PI)
    return {"D": dpre, "db": dpre}


def forward(x, w, b):
    out = gemm(x, w.t(), bias_gelu, b=b)
    return {"y": out["D"], "pre": out["pre"]}


def backward(saved, dy):
    g = tile_pass(dgelu, dy=dy, pre=saved["pre"], out=saved["pre"])
    return {"dx": gemm(g["D"], saved["w"])["D"], "dw": gemm(g["D"].t(), saved["x"])["D"], "db": g["db"]}
