"""How close a kernel's attention output must be to the float64 reference: FlashMLA's tolerances, plus the
slack that rounding P to 16 bits earns.

FlashMLA's tests allow each element 1e-3 absolute or 2/128 relative and a cosine distance of 1e-5 for
the whole output. A kernel that feeds P to the tensor cores in bf16 moves an output element by up to
2^-9 of the largest |V| it averages; where attention is peaked on a few keys (short requests, small
top-k, random inputs with a large score spread) that exceeds 1e-3 on elements near zero. So an element
may also be off by 2^-7 of its row's largest output (about max |V| there). The cosine distance, the
lse bound and the exact empty rows still catch any real mistake (a skipped tile, a wrong mask).
"""

import torch


def attention_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                    lse_atol: float = 2e-3) -> tuple[bool, float, str]:
    """(ok, max abs err, what failed) for out [..., d_v] and lse [...] against the reference's.

    Rows whose reference lse is -inf (no visible key) must be exactly out 0, lse -inf.
    """
    empty = ref_lse == float("-inf")
    ref = ref_out.double()
    err = (out.double() - ref).abs()
    max_err = err.max().item() if err.numel() else 0.0
    problems = []
    if out.isnan().any() or lse.isnan().any():
        problems.append("NaN")
    if not torch.equal(lse == float("-inf"), empty) or not (out[empty] == 0).all():
        problems.append("empty rows")
    row_max = ref.abs().amax(dim=-1, keepdim=True)
    bound = torch.maximum(torch.maximum(torch.full_like(err, 1e-3), ref.abs() * (2 / 128)), row_max * 2 ** -7)
    bad = err > bound
    if bad.any():
        problems.append(f"{int(bad.sum())} elements out of tolerance")
    a, r = out[~empty].double().flatten(), ref[~empty].flatten()
    if a.numel():
        cos_dist = 1 - (a @ r) / (a.norm() * r.norm()).clamp_min(1e-30)
        if cos_dist > 1e-5:
            problems.append(f"cosine distance {cos_dist.item():.2e}")
    lse_err = (lse[~empty].double() - ref_lse[~empty].double()).abs()
    if lse_err.numel() and lse_err.max().item() > lse_atol:
        problems.append(f"lse off by {lse_err.max().item():.2e}")
    return not problems, max_err, ", ".join(problems)
