"""QKV projection with bias and partial RoPE (the first R of each head's D columns rotated), forward
and backward, in the interleaved convention (adjacent pairs 2j, 2j+1: GPT-J's rotate_every_two,
the only one a pairs="acc" epilogue can rotate; GPT-NeoX and Phi-2 rotate halves, j with j + R/2,
which a permutation of their q and k weight rows and biases turns into this one).

One frequency per column (fp32, NH * D): per head, each pair's frequency on both of its lanes, then
D - R zeros (a rotation by 0 passes a column through), joined once per call with concat_rows; and
one per pair (NH * D / 2) for the backward, whose PairedTile pass reads a RowVec per pair.
Forward: each of q and k is one GEMM whose epilogue adds the bias and rotates the pairs by
pos[t] * freq (sin and cos reduce the angle by 2 pi); v's adds the bias.  Backward: a tile pass
rotates dq and dk back (the transposed rotation) over their pairs, a pass per gradient folds its
bias gradient, dx is three GEMMs chained through a Tile and each weight gradient a GEMM."""
from coda_agent.primitives import (ColVec, PairedTile, RowVec, Tile, concat_rows, cos, epilogue, gemm,
                                   interleave_columns, pack, row_sum, sin, tile_pass, unpack, zeros)


@epilogue(pairs="acc")
def bias_rope(acc, b: RowVec, pos: ColVec, freq: RowVec):
    e, o = unpack(acc + b)
    f, _ = unpack(freq)
    a = pos * f
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


@epilogue()
def add_bias(acc, b: RowVec):
    return {"D": acc + b}


@epilogue()
def unrope(g: PairedTile, pos: ColVec, pair_freq: RowVec):
    e, o = unpack(g)
    a = pos * pair_freq  # with a PairedTile a RowVec has one value per pair
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c + o * s, o * c - e * s)}


@epilogue(reductions={"db": row_sum()})
def col_sums(g: Tile):
    return {"db": g}


@epilogue()
def add_tile(acc, r: Tile):
    return {"D": acc + r}


def per_head(f, nh, width):
    """f (fp32, 1-D) then zeros up to ``width``, once per head, joined: (NH * width,)."""
    parts = []
    for _ in range(nh):
        parts.append(f)
        if width > f.shape[0]:
            parts.append(zeros(width - f.shape[0], f))
    return concat_rows(parts)


def forward(x, wq, bq, wk, bk, wv, bv, pos, inv_freq):
    nh, d = bq.shape
    f = inv_freq.view(1, -1)
    freq = per_head(interleave_columns(f, f).view(-1), nh, d)  # a column's pair frequency, both lanes
    pair_freq = per_head(inv_freq, nh, d // 2)  # one per pair, for the backward's PairedTile pass
    q = gemm(x, wq.t(), bias_rope, b=bq.view(-1), pos=pos, freq=freq)["D"]
    k = gemm(x, wk.t(), bias_rope, b=bk.view(-1), pos=pos, freq=freq)["D"]
    v = gemm(x, wv.t(), add_bias, b=bv.view(-1))["D"]
    return {"q": q, "k": k, "v": v, "pair_freq": pair_freq}


def backward(saved, dq, dk, dv):
    x, pos, pair_freq = saved["x"], saved["pos"], saved["pair_freq"]
    nh, d = saved["bq"].shape
    dq_pre = tile_pass(unrope, g=dq, pos=pos, pair_freq=pair_freq)["D"]
    dk_pre = tile_pass(unrope, g=dk, pos=pos, pair_freq=pair_freq)["D"]
    dx = gemm(dq_pre, saved["wq"])["D"]
    dx = gemm(dk_pre, saved["wk"], add_tile, r=dx)["D"]
    dx = gemm(dv, saved["wv"], add_tile, r=dx)["D"]
    return {"dx": dx,
            "dwq": gemm(dq_pre.t(), x)["D"], "dbq": tile_pass(col_sums, g=dq_pre)["db"].view(nh, d),
            "dwk": gemm(dk_pre.t(), x)["D"], "dbk": tile_pass(col_sums, g=dk_pre)["db"].view(nh, d),
            "dwv": gemm(dv.t(), x)["D"], "dbv": tile_pass(col_sums, g=dv)["db"].view(nh, d)}
