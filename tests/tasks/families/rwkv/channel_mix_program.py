"""RWKV's channel mix: the key GEMM squares its ReLU in the epilogue (keeping the pre-activation for
the backward), the receptance GEMM writes its pre-activation, and the value GEMM gates its own
output by sigmoid of that pre-activation (a Tile), keeping the ungated value kv for the backward.
Backward: one tile pass splits dy into the value's gradient dy * sigmoid(r) and the receptance's
dy * kv * sigmoid'(r); the relu^2 derivative 2 relu(pre) runs in the epilogue of dkv @ w_v."""
from coda_agent.primitives import Tile, epilogue, gemm, maximum, sigmoid, sigmoid_grad, tile_pass


@epilogue(outputs={"act": "bf16"})
def sqrelu(acc):
    r = maximum(acc, 0.0)
    return {"D": acc, "act": r * r}


@epilogue(outputs={"kv": "bf16"})
def gate(acc, r: Tile):
    return {"D": sigmoid(r) * acc, "kv": acc}


@epilogue(outputs={"dr": "bf16"})
def dgate(dy: Tile, r: Tile, kv: Tile):
    return {"D": dy * sigmoid(r), "dr": dy * kv * sigmoid_grad(r)}


@epilogue()
def dsqrelu(acc, pre: Tile):
    return {"D": 2.0 * acc * maximum(pre, 0.0)}


def forward(xk, xr, w_k, w_v, w_r):
    k = gemm(xk, w_k.t(), sqrelu)
    r = gemm(xr, w_r.t())["D"]
    v = gemm(k["act"], w_v.t(), gate, r=r)
    return {"y": v["D"], "pre": k["D"], "act": k["act"], "r": r, "kv": v["kv"]}


def backward(saved, dy):
    g = tile_pass(dgate, dy=dy, r=saved["r"], kv=saved["kv"])
    dkv, dr = g["D"], g["dr"]
    dxr = gemm(dr, saved["w_r"])["D"]
    dw_r = gemm(dr.t(), saved["xr"])["D"]
    dw_v = gemm(dkv.t(), saved["act"])["D"]
    dpre = gemm(dkv, saved["w_v"], dsqrelu, pre=saved["pre"], out=saved["pre"])["D"]
    dxk = gemm(dpre, saved["w_k"])["D"]
    dw_k = gemm(dpre.t(), saved["xk"])["D"]
    return {"dxk": dxk, "dxr": dxr, "dw_k": dw_k, "dw_v": dw_v, "dw_r": dw_r}
