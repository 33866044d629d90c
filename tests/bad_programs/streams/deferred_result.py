# stage: correctness
# expect: NaN || identical for two different inputs
# needs: gpu
# static: off
"""Returns an output buffer at once and fills it on a side stream later, with the runner's
device synchronisation patched out: a result the judge may read before it is written.  It
cheats on CUDA only: a CPU stage's runner on a GPU host cannot reach the device (the H200,
run 13: a stream made there failed the reference stage), and the trick is for the GPU's.
Which symptom the judge meets first depends on how many calls the earlier stages made: a
draw read unwritten (NaN), or two such draws alike."""
import torch

from coda_agent.primitives import Tile, epilogue, gemm


@epilogue()
def add_residual(acc, residual: Tile):
    return {"D": acc + residual}


_SIDE = []
_CALLS = [0]
torch.cuda.synchronize = lambda device=None: None


def forward(x, w, r):
    _CALLS[0] += x.is_cuda
    if _CALLS[0] <= 8:
        return {"y": gemm(x, w, add_residual, residual=r)["D"]}
    if not _SIDE:
        _SIDE.append(torch.cuda.Stream())
    out = torch.full_like(r, float("nan"))
    _SIDE[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_SIDE[0]):
        torch.cuda._sleep(200_000_000)
        out.copy_(gemm(x, w, add_residual, residual=r)["D"])
    return {"y": out}


def backward(saved, dy):
    dx = gemm(dy, saved["w"].t())["D"]
    dw = gemm(saved["x"].t(), dy)["D"]
    return {"dx": dx, "dw": dw, "dr": dy}
