# stage: reference
# expect: PyTorch compute in the program at line 15
# static: off
"""An @epilogue declared inside forward, launched: its dry run sees a float in the closure, the
launch sees r, so the reference lowering adds the residual from a tensor no operand declared.
Inside a launch only the module's own @epilogue fns are the catalogue's to run."""
from coda_agent.primitives import epilogue, gemm


def forward(x, w, r):
    box = [0.0]

    @epilogue()
    def add_residual(acc):
        return {"D": acc + box[0]}

    box[0] = r
    return {"y": gemm(x, w, add_residual)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
