"""docs/semantics.md in numpy float64: the oracle of the CPU tests (no torch).

Written from the formulas of §3-§6 directly, with its own broadcasting (np.repeat over heads,
np.broadcast_to over the rest), so that it shares nothing with the library's reference.
"""
import numpy as np


def _per_query_head(x, heads):
    """(B|1, H|Hk|1, Sq|1, Sk|1) -> (B|1, H, Sq|1, Sk|1): query head h reads head h // (H / Hx)."""
    return np.repeat(x, heads // x.shape[1], axis=1)


class Attention:
    """One problem: forward() gives (out, lse), backward(dout) gives (dq, dk, dv, dbias), all float64."""

    def __init__(self, q, k, v, mask=None, bias=None, softmax_scale=None, causal=False, softcap=0.0):
        batch, seqlen_q, heads, head_dim = q.shape
        seqlen_k, kv_heads = k.shape[1], k.shape[2]
        self.shapes = (q.shape, k.shape, None if bias is None else bias.shape)
        self.scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        self.softcap = softcap
        self.group = heads // kv_heads
        full = (batch, heads, seqlen_q, seqlen_k)
        self.q = q.astype(np.float64).transpose(0, 2, 1, 3)                                # (B, H, Sq, D)
        self.k = np.repeat(k.astype(np.float64).transpose(0, 2, 1, 3), self.group, axis=1)  # (B, H, Sk, D)
        self.v = np.repeat(v.astype(np.float64).transpose(0, 2, 1, 3), self.group, axis=1)

        self.raw = self.q @ self.k.transpose(0, 1, 3, 2) * self.scale                     # s * A
        logits = softcap * np.tanh(self.raw / softcap) if softcap > 0 else self.raw.copy()
        if bias is not None:
            logits = logits + np.broadcast_to(_per_query_head(bias.astype(np.float64), heads), full)
        visible = np.ones(full, dtype=bool)
        if mask is not None:
            visible &= np.broadcast_to(_per_query_head(mask.astype(bool), heads), full)
        if causal:
            i = np.arange(seqlen_q)[:, None]
            j = np.arange(seqlen_k)[None, :]
            visible &= j <= i + seqlen_k - seqlen_q
        visible &= logits > -np.inf
        with np.errstate(invalid="ignore", over="ignore"):
            shift = np.max(np.where(visible, logits, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
            shift = np.where(np.isfinite(shift), shift, 0.0)
            weights = np.where(visible, np.exp(np.where(visible, logits, 0.0) - shift), 0.0)
        total = weights.sum(axis=-1, keepdims=True)
        empty = total == 0
        self.p = weights / np.where(empty, 1.0, total)
        self.lse = np.where(empty, np.inf, shift + np.log(np.where(empty, 1.0, total)))[..., 0]

    def forward(self):
        return (self.p @ self.v).transpose(0, 2, 1, 3), self.lse

    def backward(self, dout):
        (q_shape, k_shape, bias_shape) = self.shapes
        batch, seqlen_k, kv_heads, head_dim = k_shape
        do = dout.astype(np.float64).transpose(0, 2, 1, 3)                    # (B, H, Sq, D)
        dp = do @ self.v.transpose(0, 1, 3, 2)
        delta = (self.p * dp).sum(axis=-1, keepdims=True)
        dz = self.p * (dp - delta)
        ds = dz * self.scale
        if self.softcap > 0:
            ds = ds * (1 - np.tanh(self.raw / self.softcap) ** 2)
        dq = (ds @ self.k).transpose(0, 2, 1, 3)

        def per_kv_head(x):  # (B, H, Sk, D) -> (B, Sk, Hk, D), summed over each group's heads
            return x.reshape(batch, kv_heads, self.group, seqlen_k, head_dim).sum(axis=2).transpose(0, 2, 1, 3)

        dk = per_kv_head(ds.transpose(0, 1, 3, 2) @ self.q)
        dv = per_kv_head(self.p.transpose(0, 1, 3, 2) @ do)
        dbias = None
        if bias_shape is not None:
            heads = dz.shape[1]
            dbias = dz.reshape(dz.shape[0], bias_shape[1], heads // bias_shape[1], *dz.shape[2:]).sum(axis=2)
            for d in (0, 2, 3):
                if bias_shape[d] == 1:
                    dbias = dbias.sum(axis=d, keepdims=True)
        return dq, dk, dv, dbias
