"""attention_mass (H2O/SnapKV/TOVA/PyramidKV scoring) before/after the in-place rewrite, in one process.

`before` is the previous implementation (logits scaled after the matmul, out-of-place mask,
softmax and nan_to_num); `after` is `kvcompress.methods.base.attention_mass` (queries scaled
before the matmul, in-place mask and nan_to_num). Synthetic [1, 3, n, 64] keys and [1, 9, n, 64]
queries (the default model's shape), every query causal, 1 thread, min of 2 calls each.

    python benchmarks/attention_mass_speed.py 2048 4096 8192
"""
import time, torch, sys
from kvcompress.methods import base
from kvcompress.methods.base import Tokens, visible_slots
torch.set_num_threads(1)

def before(tokens, last=None, chunk=256):
    queries, qpos = tokens.queries, tokens.query_positions
    b, hq, nq, d = queries.shape
    hkv = tokens.keys.shape[1]; group = hq // hkv
    q = queries.float().reshape(b, hkv, group, nq, d)
    keys = tokens.keys.float()
    mass = torch.zeros(b, hkv, tokens.length)
    for start in range(0, nq, chunk):
        qc = q[:, :, :, start : start + chunk]; c = qc.shape[3]
        qp = qpos[start : start + chunk]
        n = visible_slots(tokens.positions, qp)
        logits = torch.matmul(qc.reshape(b, hkv, group * c, d), keys[:, :, :n].transpose(-1, -2)).view(b, hkv, group, c, n)
        logits = logits * tokens.scale
        hidden = tokens.positions[:, :, None, None, :n] > qp[None, None, None, :, None]
        logits = logits.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        mass[:, :, :n] += probs.sum(dim=3).mean(dim=2)
    return mass

for n in map(int, sys.argv[1:]):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, n, 64, generator=g); v = torch.randn(1, 3, n, 64, generator=g); q = torch.randn(1, 9, n, 64, generator=g)
    pos = torch.arange(n).expand(1, 3, n)
    tok = Tokens(k, v, pos, q, None, 0.125, 0, 1, torch.arange(n))
    res = {}
    for name, fn in (("before", before), ("after", base.attention_mass), ("before", before), ("after", base.attention_mass)):
        t = time.perf_counter(); out = fn(tok); dt = time.perf_counter() - t
        res.setdefault(name, []).append(dt); res[name + "_out"] = out
    err = ((res["before_out"] - res["after_out"]).abs().max() / res["before_out"].abs().max()).item()
    print(f"n={n}: before {min(res['before']):.3f} s, after {min(res['after']):.3f} s, speed-up {min(res['before'])/min(res['after']):.2f}x, max rel diff {err:.1e}")
