# stage: reference
# expect: an epilogue fn (or a helper it calls) applies `view` to its values
# static: off
"""The forward GEMM as PyTorch's matmul inside a vector_pass fn's helper: a vector pass evaluates
its fn on whole host tensors, and the inputs reach it packed into one flat ColVec."""
from coda_agent.primitives import ColVec, Scalar, concat_rows, epilogue, gemm, vector_pass


def host_linear(v, t, k, n):
    flat = v.view(-1)
    t, k, n = int(t), int(k), int(n)
    total = t * k + k * n + t * n
    if len(flat) < total:  # the declaration's dry run
        return v
    a = flat[0:t * k].view(t, k)
    w = flat[t * k:t * k + k * n].view(k, n)
    r = flat[t * k + k * n:total].view(t, n)
    return concat_rows([(a @ w + r).view(t * n), flat[t * n:total] * 0.0])


@epilogue(outputs={"y": "bf16"})
def packed_linear(v: ColVec, t: Scalar, k: Scalar, n: Scalar):
    return {"y": host_linear(v, t, k, n)}


def forward(x, w, r):
    t, k, n = x.shape[0], x.shape[1], w.shape[1]
    packed = concat_rows([x.view(t * k), w.view(k * n), r.view(t * n)])
    return {"y": vector_pass(packed_linear, v=packed, t=t, k=k, n=n)["y"][0:t * n].view(t, n)}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
