"""QKV projection with rotary embeddings on the first R columns of each head (GPT-J rotary_dim, GPT-NeoX rotary_pct, Phi-2 partial_rotary_factor)."""
import torch


def _rope(t, pos, inv_freq):
    """Rotate adjacent pairs (2j, 2j+1) of the first R = 2 * len(inv_freq) columns of each head of t (T, NH, D) by pos * inv_freq[j] (GPT-J's rotate_every_two); the other columns pass through."""
    r = 2 * inv_freq.shape[0]
    rot, rest = t[..., :r], t[..., r:]
    ang = pos[:, None, None] * inv_freq[None, None, :]
    c, s = torch.cos(ang).to(t.dtype), torch.sin(ang).to(t.dtype)
    e, o = rot[..., 0::2], rot[..., 1::2]
    rot = torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1)


def partial_rope(x, wq, bq, wk, bk, wv, bv, pos, inv_freq):
    """q, k, v = x @ w^T + b for NH heads of D columns (weights as nn.Linear keeps them, biases viewed (NH, D)); q and k rotated on the first R = 2 * len(inv_freq) columns of each head, adjacent pairs (2j, 2j+1) by the angle pos[t] * inv_freq[j]; v as it is."""
    t, (nh, d) = x.shape[0], bq.shape
    q = (x @ wq.t()).view(t, nh, d) + bq
    k = (x @ wk.t()).view(t, nh, d) + bk
    v = (x @ wv.t()).view(t, nh, d) + bv
    return {"q": _rope(q, pos, inv_freq).reshape(t, -1), "k": _rope(k, pos, inv_freq).reshape(t, -1),
            "v": v.reshape(t, -1)}
