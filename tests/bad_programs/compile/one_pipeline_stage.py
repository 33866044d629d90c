# stage: compile
# expect: leaves 1 A/B pipeline stage
from coda_agent.primitives import Tile, TileConfig, epilogue, gemm


@epilogue(outputs={"a": "fp32", "b": "fp32", "c2": "fp32", "d": "fp32"})
def add_residual_wide(acc, residual: Tile):
    y = acc + residual
    return {"D": y, "a": y * 2.0, "b": y * 3.0, "c2": y * 4.0, "d": y * 5.0}


def forward(x, w, r):
    # A cooperative 256-wide tile picked by hand, with four fp32 tiles staged beside D and
    # the residual: the epilogue's buffers leave quack's mainloop one A/B stage, which deadlocks.
    out = gemm(x, w, add_residual_wide, residual=r, config=TileConfig(128, 256, 1, 1, False))
    return {"y": out["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
