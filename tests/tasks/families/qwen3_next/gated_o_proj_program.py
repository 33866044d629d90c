"""Qwen3-Next's gated attention output into o_proj.  The gated product is the GEMM's A operand, so a
tile pass writes it (no GEMM produces o or the gate: attention does); the GEMM adds the residual.
Backward: dy @ w_o gives the gated product's gradient, whose epilogue splits it into do and dgate
from the saved o and gate; dw_o reads the gated product kept from the forward; h's gradient is dy."""
from coda_agent.primitives import Tile, epilogue, gemm, sigmoid, sigmoid_grad, tile_pass


@epilogue()
def gated(o: Tile, gate: Tile):
    return {"D": o * sigmoid(gate)}


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


@epilogue(outputs={"dgate": "bf16"})
def dgated(acc, o: Tile, gate: Tile):
    return {"D": acc * sigmoid(gate), "dgate": acc * o * sigmoid_grad(gate)}


def forward(h, o, gate, w_o):
    a = tile_pass(gated, o=o, gate=gate)["D"]
    y = gemm(a, w_o.t(), add_residual, residual=h)["D"]
    return {"y": y, "a": a}


def backward(saved, dy):
    d = gemm(dy, saved["w_o"], dgated, o=saved["o"], gate=saved["gate"])
    dw_o = gemm(dy.t(), saved["a"])["D"]
    return {"dh": dy, "do": d["D"], "dgate": d["dgate"], "dw_o": dw_o}
