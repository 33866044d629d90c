# stage: reference
# expect: raised ValueError
"""Raises with a lone surrogate (and a terminal's escape sequences) in its message: no UTF-8
encodes a surrogate, so the report's JSON could not be written, and `verify` crashed after its
verdict (in the verdict cache's put, then the run directory's report).  Every text of a report is
written printable: a surrogate as its escape, as control characters are."""
from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    raise ValueError("surrogate \ud800 and \x1b[2J\x1b]0;accepted\x07 in the message")


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
