# stage: reference
# expect: all zeros
# static: off
"""Walks the frames up from forward into the runner, and patches what it finds there: the
runner's result checks and the verifier's comparison, as a program that escaped the AST rules
would.  They are the runner's copies; the judge compares in another process."""
import sys

from coda_agent.primitives import Tile, epilogue, gemm, zeros_like


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def _no_mismatch(*args, **kwargs):
    return None


def _accept_results(contract, results, *args, **kwargs):
    return results


def forward(x, w, r):
    f = sys._getframe()
    while f is not None:  # up through the runner: its modules, as the frames reach them
        name = f.f_globals.get("__name__", "")
        if name.startswith("coda_agent.verifier"):
            module = sys.modules[name]
            for attr, fake in (("compare", _no_mismatch), ("verdict", _no_mismatch),
                               ("check_results", _accept_results)):
                if hasattr(module, attr):
                    setattr(module, attr, fake)
            if hasattr(module, "prog"):
                module.prog.check_results = _accept_results
        f = f.f_back
    return {"y": zeros_like(r)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
