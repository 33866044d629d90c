# stage: reference
# expect: Read-only file system
# static: off
"""Writes beside the run directories and into the checkout and /tmp, then reports what happened."""
import os

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    here = os.path.dirname(os.path.dirname(os.path.abspath(gemm.__code__.co_filename)))
    out = []
    for path in (os.path.join(here, "runs", "forged.txt"), os.path.join(here, "forged.txt"), "/tmp/coda-forged.txt"):
        try:
            with open(path, "w") as f:
                f.write("accepted")
            out.append(f"{path}: written")
        except OSError as e:
            out.append(f"{path}: {e.strerror}")
    raise RuntimeError("; ".join(out))


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
