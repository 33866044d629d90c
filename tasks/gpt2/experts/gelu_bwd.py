"""The MLP's second GEMM backward through the exact GELU, one GEMM.

da = dout @ w_proj; the epilogue reads the saved pre-activation as a tile,
multiplies by gelu'(pre) = Phi(pre) + pre * phi(pre) and folds the fc bias
gradient sum_rows(dpre) (a row_sum: one value per column).

Floor: 1 GEMM; beyond its operands and output, the read of pre."""

from coda_agent.primitives import Tile, epilogue, erf, exp, gemm, row_sum

SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)


@epilogue(reductions={"db": row_sum()})
def dgelu(acc, pre: Tile):
    dpre = acc * (0.5 * (1.0 + erf(pre * SQRT_HALF)) + pre * exp(-0.5 * pre * pre) * INV_SQRT_2PI)
    return {"D": dpre, "db": dpre}


def forward(dout, w_proj, pre):
    out = gemm(dout, w_proj, dgelu, pre=pre)
    return {"dpre": out["D"], "db": out["db"]}
