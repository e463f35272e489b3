"""How the projected key sketch's basis holds up when it is fitted on a short prompt (issue 28).

`tierattn eval keytier`'s probe (SmolLM2, 2 segments of 2048 tokens, 8-token pages, 10% of the
candidate pages kept, probes at the last 64 positions) with the projection fitted on only the
first FIT tokens of each segment (the quantization range still from the whole prompt), for:

* ``logits``: the runtime's basis (`tierattn.importance.key_basis`: the top eigenvectors of
  Cq^1/2 Ck Cq^1/2 from the fitted tokens' post-RoPE keys and queries);
* ``rope-planes``: whole RoPE planes (channel pairs (i, i + D/2), SmolLM2's layout) ranked by the
  product of their query and key energies -- a subspace RoPE's rotation maps onto itself, so
  what is kept does not depend on the positions the fit saw.

Prints the attention mass missed as a multiple of the oracle's, at 3/8 and 1/4 of the head dim.

    python eval/results/keytier-smollm2-ctx2048-s2-ps8-r0.1/fit_window.py
"""

import torch

import tierattn.eval.keytier as kt
from tierattn.eval.fidelity import FidelitySpec, _segments, load_smollm2

runtime_basis = kt.key_basis


def rope_planes(keys, lens, rank, queries=None):
    k = keys.float()  # [1, N, H, D]
    ek = (k ** 2).sum((0, 1))
    h, d = ek.shape
    eq = torch.ones_like(ek) if queries is None else (queries.float() ** 2).sum((0, 2))
    half = d // 2
    score = (eq[:, :half] + eq[:, half:]) * (ek[:, :half] + ek[:, half:])
    top = score.topk(rank // 2, dim=1).indices
    out = torch.zeros(h, d, rank, device=keys.device)
    for i in range(h):
        for j, p in enumerate(top[i].tolist()):
            out[i, p, 2 * j] = out[i, p + half, 2 * j + 1] = 1.0
    return out


model, tok = load_smollm2()
spec = kt.KeyTierSpec(page_size=8, recall=0.1,
                      selectors=("oracle", "sketch-4", "sketch-4-r0.375", "sketch-4-r0.25"))
segs = _segments(tok, FidelitySpec(segments=spec.segments, prefix=spec.context, continuation=0))
print("basis        fit tokens  sketch-4 (every channel)  3/8 of the channels  1/4")
for name, fn in (("logits", runtime_basis), ("rope-planes", rope_planes)):
    for fit in (64, 256, spec.context - spec.continuation):
        def windowed(keys, lens, rank, queries=None, fn=fn, fit=fit):
            return fn(keys[:, :fit], torch.clamp(lens, max=fit), rank,
                      None if queries is None else queries[:fit])
        kt.key_basis = windowed
        rows = {r["selector"]: r["vs_oracle"]
                for r in kt.probe_key_tiers(model, segs, spec, progress=False)}
        print(f"{name:<12} {fit:>10}  {rows['sketch-4']:>24.3f}  {rows['sketch-4-r0.375']:>19.3f}"
              f"  {rows['sketch-4-r0.25']:.3f}")
