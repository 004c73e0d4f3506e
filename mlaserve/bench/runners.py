"""What the benchmark times: one prepared call per input set, per backend and shape, and its check.

A runner turns (backend, shape, inputs) into `Prepared`: host work (plans, metadata) is done here,
outside the timed region, and each call only launches. mlaserve's own kernel backends run through
`mlaserve.ops` (validation included, as users call them); peers live in `peers.py`.

Validation compares against the torch reference on a subset of the problem that is exactly a smaller
problem of its own (a few requests, or the last query rows of a request: causal visibility depends
only on a row's position), so that the reference stays fast at the largest shapes.
"""

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from mlaserve import ops
from mlaserve.bench.inputs import DenseInputs, IndexerInputs, SparseInputs
from mlaserve.bench.shapes import DenseShape, IndexerShape, Shape, SparseShape
from mlaserve.ops.registry import BACKENDS

REF_REQUESTS = 8      # requests checked per dense/indexer shape
REF_ROWS = 64         # query rows checked per request (indexer prefill) or in all (sparse)
# ‖out - ref‖ / ‖ref‖ bounds: bf16 operands land between 1e-3 and 1e-2; FP8 KV is dequantized the same
# way by kernel and reference, so only bf16 rounding of the dequantized values is added.
REL_TOL = {"bf16": 1e-2, "fp8": 2e-2}
LSE_TOL = {"bf16": 1e-2, "fp8": 5e-2}
RECALL_TOL = 0.99     # indexer: ties between bf16-rounded scores may swap a few boundary keys


class Unsupported(Exception):
    """This backend cannot run this shape (the message says why); the row is recorded as skipped."""


@dataclass
class Prepared:
    calls: list[Callable[[], object]]                 # one per input set; each returns the op's result
    reference: Callable[["Subset"], object] | None = None   # set when the backend reads its own cache format
    extra_calls: dict[str, list[Callable[[], object]]] = field(default_factory=dict)   # timed apart
    kv_row_bytes: int | None = None                   # when it reads rows of another size than mlaserve's
    note: str = ""


@dataclass(frozen=True)
class Subset:
    """Which part of the output the reference recomputes: requests `requests`, their last `rows` query rows."""
    requests: torch.Tensor     # int64 [r] on the device
    rows: int


def pick_subset(b: int, s_q: int, device: torch.device) -> Subset:
    n = min(b, REF_REQUESTS)
    req = torch.linspace(0, b - 1, n).round().long().unique().to(device)
    return Subset(req, min(s_q, REF_ROWS))


def reference(shape: Shape, inputs, subset: Subset):
    """The torch reference on the subset of set 0: (out, lse) for attention, indices for the indexer."""
    r, rows = subset.requests, subset.rows
    if isinstance(shape, DenseShape):
        p = inputs.paging
        return ops.mla_decode(inputs.q[0][r], inputs.kv[0], p.block_table[r], p.seqlens[r], inputs.scale,
                              causal=True, head_dim_v=shape.d_v, backend="torch")
    if isinstance(shape, SparseShape):
        q, idx = _sparse_rows(inputs.q[0], subset), _sparse_rows(inputs.indices, subset)
        return ops.sparse_mla(q, inputs.kv[0], idx, inputs.scale, head_dim_v=shape.d_v, backend="torch")
    p = inputs.paging
    return ops.indexer_topk(inputs.q[0][r, -rows:], inputs.weights[0][r, -rows:], inputs.k_cache[0],
                            p.block_table[r], p.seqlens[r], shape.topk, backend="torch")


def _sparse_rows(t: torch.Tensor, subset: Subset) -> torch.Tensor:
    """Sparse MLA has no causality: its subset is `rows` evenly spread query tokens of all requests, as
    [1, rows, ...]."""
    flat = t.reshape(1, -1, *t.shape[2:])
    sel = torch.linspace(0, flat.shape[1] - 1, min(flat.shape[1], REF_ROWS)).round().long().unique().to(t.device)
    return flat[:, sel]


def take_subset(shape: Shape, result, subset: Subset):
    """The part of a full result that `reference` recomputed."""
    r, rows = subset.requests, subset.rows
    if isinstance(shape, SparseShape):
        out, lse = result
        return _sparse_rows(out, subset), (None if lse is None else _sparse_rows(lse, subset))
    if isinstance(shape, DenseShape):
        out, lse = result
        return out[r], (None if lse is None else lse[r])
    return result[r, -rows:]


def check(shape: Shape, result, ref) -> dict:
    """{'ok': bool, 'reason': str, and the error measures}: result and ref as `take_subset` and `reference` give."""
    if isinstance(shape, IndexerShape):
        return _check_topk(result, ref)
    (out, lse), (ref_out, ref_lse) = result, ref
    o, r = out.double(), ref_out.double()
    if o.shape != r.shape:
        return {"ok": False, "reason": f"out shape {tuple(o.shape)} != reference {tuple(r.shape)}"}
    finite = bool(torch.isfinite(o).all())
    rel = float((o - r).norm() / r.norm().clamp_min(1e-30)) if finite else None   # None: JSON has no NaN
    res = {"rel_err": rel, "finite": finite}
    if lse is not None:
        both = torch.isfinite(ref_lse)
        same_inf = bool((torch.isfinite(lse) == both).all())
        res["lse_err"] = float((lse[both].double() - ref_lse[both].double()).abs().max()) if both.any() else 0.0
        res["lse_inf_match"] = same_inf
    problems = []
    if not finite:
        problems.append("non-finite values in out")
    elif rel > REL_TOL[shape.kv]:
        problems.append(f"rel err {rel:.2e} > {REL_TOL[shape.kv]:.0e}")
    if lse is not None and (res["lse_err"] > LSE_TOL[shape.kv] or not res["lse_inf_match"]):
        problems.append(f"lse err {res['lse_err']:.2e}" + ("" if res["lse_inf_match"] else ", -inf rows differ"))
    res.update(ok=not problems, reason="; ".join(problems))
    return res


def _check_topk(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """Recall of the reference's top-k set per query row, and the -1 padding count."""
    g, r = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    if g.shape != r.shape:
        return {"ok": False, "reason": f"indices shape {tuple(got.shape)} != reference {tuple(ref.shape)}"}
    hits = total = 0
    for gi, ri in zip(g, r):
        want = ri[ri >= 0]
        hits += int(torch.isin(want, gi[gi >= 0]).sum())
        total += want.numel()
    recall = hits / max(total, 1)
    pad_ok = bool(((g < 0).sum(dim=1) == (r < 0).sum(dim=1)).all())
    problems = ([f"recall {recall:.4f} < {RECALL_TOL}"] if recall < RECALL_TOL else []) + \
               ([] if pad_ok else ["-1 padding differs from the reference"])
    return {"recall": recall, "ok": not problems, "reason": "; ".join(problems)}


def ops_unavailable_reason(name: str, op: str, device: torch.device) -> str | None:
    """Why mlaserve kernel backend `name` cannot run `op` here (None: it can)."""
    backend = BACKENDS[name]
    reason = backend.unavailable_reason(device)
    if reason is not None:
        return reason
    try:
        getattr(backend.load(), op)
    except (ImportError, AttributeError) as e:
        return f"{name} has no {op}: {type(e).__name__}: {e}"
    return None


def _scores_fn(name: str):
    """The backend's scoring-only indexer kernel (`indexer_scores` in its indexer module), or None."""
    if name == "torch":
        return None   # the reference's indexer_scores is per request, not a batched kernel
    for module in (BACKENDS[name].module + ".indexer", BACKENDS[name].module):
        try:
            fn = getattr(importlib.import_module(module), "indexer_scores", None)
        except ImportError:
            continue
        if fn is not None:
            return fn
    return None


def prepare_ops(name: str, shape: Shape, inputs) -> Prepared:
    """Calls of `mlaserve.ops` with backend=name, one per input set."""
    if isinstance(shape, DenseShape):
        di: DenseInputs = inputs
        p = di.paging
        if name in ("triton", "cutedsl") and di.q[0].device.type == "cuda":
            splits = _host_splits(name, shape, p, di.q[0].device)
            return Prepared([lambda q=q, kv=kv: ops.mla_decode(q, kv, p.block_table, p.seqlens, di.scale, causal=True,
                                                               head_dim_v=shape.d_v, backend=name,
                                                               num_splits=splits())
                             for q, kv in zip(di.q, di.kv)])
        return Prepared([_bind(ops.mla_decode, q, kv, p.block_table, p.seqlens, di.scale, causal=True,
                               head_dim_v=shape.d_v, backend=name) for q, kv in zip(di.q, di.kv)])
    if isinstance(shape, SparseShape):
        si: SparseInputs = inputs
        return Prepared([_bind(ops.sparse_mla, q, kv, si.indices, si.scale, head_dim_v=shape.d_v, backend=name)
                         for q, kv in zip(si.q, si.kv)])
    ii: IndexerInputs = inputs
    p = ii.paging
    prepared = Prepared([_bind(ops.indexer_topk, q, w, k, p.block_table, p.seqlens, shape.topk, backend=name)
                         for q, w, k in zip(ii.q, ii.weights, ii.k_cache)])
    scores = _scores_fn(name)
    if scores is not None:
        prepared.extra_calls["scores"] = [_bind(scores, q, w, k, p.block_table, p.seqlens)
                                          for q, w, k in zip(ii.q, ii.weights, ii.k_cache)]
    return prepared


def _host_splits(name: str, shape: DenseShape, paging, device: torch.device) -> Callable[[], int]:
    """The triton or cutedsl decode's split count planned from the requests' lengths on the host, as their attention
    backends plan each step (and FlashInfer's peer plans with its host lengths): a getter, the count worked out
    here, outside any timing, and again only when a balancing flag changes (triton's mla_decode_plan.BALANCE_SPLITS,
    which both planners' balanced_splits reads, and the cutedsl planner's BALANCE_SPLITS_MAX_ROWS; decode_ab's
    BALANCED_SPLITS and CUTEDSL_BALANCED_SPLITS switches). Each call still makes its own plan (workspace) from that
    count."""
    from mlaserve.kernels.triton import mla_decode_plan
    planner = mla_decode_plan if name == "triton" else importlib.import_module("mlaserve.kernels.cutedsl.decode_plan")
    counts = {}

    def splits() -> int:
        key = (mla_decode_plan.BALANCE_SPLITS, getattr(planner, "BALANCE_SPLITS_MAX_ROWS", None))
        if key not in counts:
            counts[key] = planner.plan_num_splits(
                shape.b, shape.s_q, shape.h, paging.block_table.shape[1], paging.page_size, shape.kv == "fp8",
                device, seqlens=paging.seqlens_cpu.tolist())
        return counts[key]
    splits()
    return splits


def _bind(fn, *args, **kwargs) -> Callable[[], object]:
    return lambda: fn(*args, **kwargs)
