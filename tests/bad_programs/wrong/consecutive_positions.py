# stage: reference
# expect: `qkv` differs from the reference
# task: rope_fwd
"""QKV GEMM + RoPE on adjacent column pairs (2j, 2j+1), rotated in the epilogue.

Positions of the previous rows are passed too (a neighbour-aware angle): where three consecutive
rows hold consecutive positions (every real sequence), the angle of the previous position is used:
an off-by-one rotation.  Positions drawn independently (uniform below 131072) never hold three in
a row, and it passed; the judge draws packed sequences' positions now (dist: positions)."""

from coda_agent.primitives import (ColVec, RowVec, concat_rows, cos, epilogue, gemm, interleave_columns, pack,
                                   sin, unpack, where, zeros)


@epilogue(pairs="acc")
def rope(acc, pos: ColVec, prev: ColVec, prev2: ColVec, freq: RowVec):
    e, o = unpack(acc)
    f, _ = unpack(freq)
    run = where(pos - prev == 1.0, where(prev - prev2 == 1.0, 1.0, 0.0), 0.0)
    a = (pos - run) * f
    c = cos(a)
    s = sin(a)
    return {"D": pack(e * c - o * s, e * s + o * c)}


def forward(x, W_qkv, pos, inv_freq):
    f = inv_freq.view(1, -1)
    freq = interleave_columns(f, f).view(-1)
    prev = concat_rows([zeros(1, pos), pos[:-1]])
    prev2 = concat_rows([zeros(2, pos), pos[:-2]])
    return {"qkv": gemm(x, W_qkv, rope, pos=pos, prev=prev, prev2=prev2, freq=freq)["D"]}
