"""LM-head cross-entropy with label smoothing and z-loss, one step, chunked over tokens.

Per chunk: the logits GEMM writes z in fp32 with online_lse, the target logit (select_col) and
sum_j z_j (col_sum: 0 in padded lanes, where acc is) in its epilogue; a vector pass finishes
each row's loss and the three coefficients of its gradient,
dz_j = ca * exp(z_j - lse) - cb * onehot_j(target) - cc with ca = dloss (1 + 2 z_weight lse),
cb = dloss (1 - smoothing), cc = dloss smoothing / V, all 0 on ignored rows (a target outside
[0, V)); a tile pass writes dz in bf16; then dx[chunk] = dz @ w and dw += dz^T @ x[chunk]."""
from coda_agent.primitives import (ColVec, RowVec, Scalar, Tile, col_sum, column_index, concat_rows, epilogue,
                                   exp, gemm, online_lse, select_col, tile_pass, to_fp32, vector_pass, where,
                                   zeros_like)

LOGITS_BYTES = 256 * 2**20


@epilogue(reductions={"lse": online_lse(), "target_logit": select_col("target"), "zsum": col_sum()})
def logits(acc):
    return {"D": acc, "lse": acc, "target_logit": acc, "zsum": acc}


@epilogue(outputs={"ca": "fp32", "cb": "fp32", "cc": "fp32"})
def row_terms(lse: ColVec, tl: ColVec, zsum: ColVec, tgt: ColVec, dloss: ColVec, vocab: Scalar,
              inv_vocab: Scalar, smoothing: Scalar, z_weight: Scalar):
    keep = where(tgt >= 0.0, where(tgt < vocab, 1.0, 0.0), 0.0)
    loss = lse - (1.0 - smoothing) * tl - smoothing * zsum * inv_vocab + z_weight * lse * lse
    g = dloss * keep
    return {"D": keep * loss, "ca": g * (1.0 + 2.0 * z_weight * lse), "cb": g * (1.0 - smoothing),
            "cc": g * smoothing * inv_vocab}


@epilogue()
def dlogits(lg: Tile, lse: ColVec, tgt: ColVec, col: RowVec, ca: ColVec, cb: ColVec, cc: ColVec):
    return {"D": ca * exp(lg - lse) - where(col == tgt, cb, 0.0) - cc}


def forward(x, w, target, dloss, smoothing, z_weight):
    t, v = x.shape[0], w.shape[0]
    chunk = min(t, max(128, LOGITS_BYTES // (4 * v) // 128 * 128))
    col = column_index(v, x.device)
    tgt = to_fp32(target)
    dx = zeros_like(x)
    dw = None
    losses = []
    for r0 in range(0, t, chunk):
        r1 = min(r0 + chunk, t)
        x_c = x[r0:r1]
        res = gemm(x_c, w.t(), logits, out_dtype="fp32", target=target[r0:r1])
        k = vector_pass(row_terms, lse=res["lse"], tl=res["target_logit"], zsum=res["zsum"], tgt=tgt[r0:r1],
                        dloss=dloss[r0:r1], vocab=float(v), inv_vocab=1.0 / v, smoothing=smoothing,
                        z_weight=z_weight)
        losses.append(k["D"])
        dl = tile_pass(dlogits, lg=res["D"], lse=res["lse"], tgt=tgt[r0:r1], col=col, ca=k["ca"], cb=k["cb"],
                       cc=k["cc"], out_dtype="bf16")["D"]
        gemm(dl, w, accumulate_into=dx[r0:r1])
        if dw is None:
            dw = gemm(dl.t(), x_c)["D"]
        else:
            gemm(dl.t(), x_c, accumulate_into=dw)
        del res, dl
    return {"loss": concat_rows(losses), "dx": dx, "dw": dw}
