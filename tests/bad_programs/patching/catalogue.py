# stage: reference
# expect: differs from the reference
# static: off
"""Replaces the catalogue's gemm in this process with one that skips the residual."""
import coda_agent.primitives as catalogue
import coda_agent.primitives.gemm as gemm_module

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_real = gemm


def _lazy(A, B, epilogue=None, **kw):
    return _real(A, B)


def forward(x, w, r):
    catalogue.gemm = gemm_module.gemm = _lazy
    return {"y": catalogue.gemm(x, w, add_residual, residual=r)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
