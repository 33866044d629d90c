"""MiniCPM's width-scaled LM head and its cross-entropy, one step, chunked over tokens.

The scale 1 / (H / dim_model_base) commutes with the head's GEMM, so the logits epilogue applies it
to the accumulator (x itself is the A operand).  MiniCPM's vocabulary (122753) leaves a logits row
no multiple of 16 bytes, so the head's weight is padded to a multiple of 8 rows and the padding's
logits are masked out of the log-sum-exp (-1e30: exp of it is 0, so their gradient is 0 too).  Per
chunk: the logits GEMM writes z in fp32 with online_lse and the target logit; a vector pass finishes
each row's loss and its gradient's coefficient dloss * scale (0 on ignored rows); a tile pass
writes dz = coef * (softmax - onehot) in bf16; dx[chunk] = dz @ w and dw += dz^T @ x[chunk]."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, column_index, concat_rows, epilogue, exp, gemm,
                                   online_lse, pad, select_col, tile_pass, to_fp32, vector_pass, where, zeros_like)

LOGITS_BYTES = 256 * 2**20


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target")})
def logits(acc, col: RowVec, vocab: Scalar, scale: Scalar):
    z = where(col < vocab, acc * scale, -1.0e30)
    return {"D": z, "lse": z, "target_logit": z}


@epilogue(outputs={"coef": "fp32"})
def row_terms(lse: ColVec, tl: ColVec, tgt: ColVec, dloss: ColVec, vocab: Scalar, scale: Scalar):
    keep = where(tgt >= 0.0, where(tgt < vocab, 1.0, 0.0), 0.0)
    return {"D": keep * (lse - tl), "coef": keep * dloss * scale}


@epilogue()
def dlogits(lg: Tile, lse: ColVec, tgt: ColVec, col: RowVec, coef: ColVec):
    return {"D": coef * (exp(lg - lse) - where(col == tgt, 1.0, 0.0))}


def forward(x, w, target, dloss, dim_model_base):
    t, h, v = x.shape[0], x.shape[1], w.shape[0]
    scale = dim_model_base / h
    vp = (v + 7) // 8 * 8
    wp = pad(w, rows=vp)
    chunk = min(t, max(128, LOGITS_BYTES // (4 * vp) // 128 * 128))
    col = column_index(vp, x.device)
    tgt = to_fp32(target)
    dx = zeros_like(x)
    dw = None
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        x_c = x[r0:r1]
        res = gemm(x_c, wp.t(), logits, out_dtype="fp32", target=target[r0:r1], col=col, vocab=float(v),
                   scale=scale)
        k = vector_pass(row_terms, lse=res["lse"], tl=res["target_logit"], tgt=tgt[r0:r1], dloss=dloss[r0:r1],
                        vocab=float(v), scale=scale)
        losses.append(k["D"])
        dl = tile_pass(dlogits, lg=res["D"], lse=res["lse"], tgt=tgt[r0:r1], col=col, coef=k["coef"],
                       out_dtype="bf16")["D"]
        gemm(dl, wp, accumulate_into=dx[r0:r1])
        if dw is None:
            dw = gemm(dl.t(), x_c)["D"]
        else:
            gemm(dl.t(), x_c, accumulate_into=dw)
        del res, dl
    return {"loss": concat_rows(losses), "dx": dx, "dw": pad(dw[:v])}
