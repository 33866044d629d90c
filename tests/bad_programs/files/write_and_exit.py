# stage: reference
# expect: the program ended the runner process (exit code 0)
# static: off
"""Tries to leave a results file behind for the harness and exits without a reply."""
import os

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


def forward(x, w, r):
    for path in ("results.jsonl", "../results.jsonl", "/tmp/results.jsonl"):
        try:
            with open(path, "a") as f:
                f.write('{"result": {"name": "reference", "status": "passed"}}\n')
        except OSError:
            pass
    os._exit(0)


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
