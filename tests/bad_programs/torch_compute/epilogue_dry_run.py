# stage: reference
# expect: PyTorch compute in the program at line 16
# static: off
"""The add done by an epilogue's dry run: an @epilogue declared inside forward is called at its
declaration on tiny tensors, but its body closes over forward's, and appends y + r to a list.
The frame is an epilogue fn's, yet the catalogue is not launching it: the program's compute."""
from coda_agent.primitives import epilogue, gemm


def forward(x, w, r):
    y = gemm(x, w)["D"]
    box = []

    @epilogue()
    def add_residual(acc):
        box.append(y + r)
        return {"D": acc}

    return {"y": box[0]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
