# stage: reference
# expect: an epilogue fn (or a helper it calls) applies `view` to its values
# static: off
# task: out_proj_residual
"""the forward GEMM runs as PyTorch inside a vector_pass
fn's helper, as a Python sum of K outer products (slices, broadcast `*`, builtin `sum`: none of
them on the audit's never-in-an-epilogue list, unlike `matmul`).  A throwaway catalogue gemm
gives the compile stage a kernel to look at."""

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
    y = sum(a[:, i:i + 1] * w[i:i + 1, :] for i in range(k)) + r
    return concat_rows([y.view(t * n), flat[t * n:total] * 0.0])


@epilogue(outputs={"y": "bf16"})
def packed_linear(v: ColVec, t: Scalar, k: Scalar, n: Scalar):
    return {"y": host_linear(v, t, k, n)}


def forward(attn, Wo, residual):
    t, k, n = attn.shape[0], attn.shape[1], Wo.shape[1]
    gemm(attn[0:128], Wo)  # for the compile stage
    packed = concat_rows([attn.view(t * k), Wo.view(k * n), residual.view(t * n)])
    return {"y": vector_pass(packed_linear, v=packed, t=t, k=k, n=n)["y"][0:t * n].view(t, n)}


def backward(saved, dy, needs):
    grads = {"dresidual": dy}
    if "dattn" in needs:
        grads["dattn"] = gemm(dy, saved["Wo"].t())["D"]
    if "dWo" in needs:
        grads["dWo"] = gemm(saved["attn"].t(), dy)["D"]
    return grads
