# stage: static
# expect: is declared inside a function: declare epilogue fns at module level
"""An epilogue declared inside forward: the catalogue dry-runs it at each declaration, and its body
closes over the call's own tensors (the runtime cases: epilogue_dry_run, nested_epilogue_launch)."""
from coda_agent.primitives import epilogue, gemm


def forward(x, w, r):
    @epilogue()
    def add_residual(acc):
        return {"D": acc}

    return {"y": gemm(x, w, add_residual)["D"]}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
