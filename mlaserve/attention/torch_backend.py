"""The `torch` attention backend: the reference ops, on any device."""

import torch

from mlaserve import ops
from mlaserve.attention.base import AttentionBackend
from mlaserve.attention.batch import BatchLayout, ForwardMode


def _ragged_mha(q, k, v, layout: BatchLayout, softmax_scale: float) -> torch.Tensor:
    """Causal MHA per request in float32: token at position p sees context positions 0..p.

    q [T, h, d_qk]; k [Tk, h, d_qk]; v [Tk, h, d_v] -> [T, h, d_v] in q's dtype.
    """
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    q_start = k_start = 0
    for prefix, ext in zip(layout.prefix_lens, layout.extend_lens):
        n = prefix + ext
        qi = q[q_start:q_start + ext].float().transpose(0, 1)       # [h, ext, d_qk]
        ki = k[k_start:k_start + n].float().transpose(0, 1)         # [h, n, d_qk]
        vi = v[k_start:k_start + n].float().transpose(0, 1)         # [h, n, d_v]
        scores = torch.matmul(qi, ki.transpose(1, 2)) * softmax_scale
        q_pos = torch.arange(prefix, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]   # [ext, n]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[q_start:q_start + ext] = torch.matmul(probs, vi).transpose(0, 1).to(q.dtype)
        q_start += ext
        k_start += n
    return out


class TorchBackend(AttentionBackend):
    """Dense and sparse MLA through `mlaserve.ops` with backend="torch"."""
    name = "torch"
    kernel_backend = "torch"   # what this backend asks of mlaserve.ops

    def __init__(self, config, extend_form: str = "mha"):
        super().__init__(config)
        if extend_form not in ("mha", "absorbed"):
            raise ValueError(f"extend_form must be 'mha' or 'absorbed', got {extend_form!r}")
        self.extend_form = extend_form

    def extend_uses_mha(self, layout):
        return self.extend_form == "mha"

    @staticmethod
    def _paging(layout: BatchLayout):
        """Block table and lengths as mla_decode sees them: per request in DECODE, per token in EXTEND."""
        if layout.mode is ForwardMode.DECODE:
            return layout.block_table, layout.cache_seqlens
        return layout.token_block_table, layout.token_seqlens

    def mla(self, q, kv_cache, layout, meta, softmax_scale, head_dim_v):
        block_table, seqlens = self._paging(layout)
        out, _ = ops.mla_decode(q.unsqueeze(1), kv_cache, block_table, seqlens, softmax_scale,
                                causal=True, head_dim_v=head_dim_v, backend=self.kernel_backend)
        return out.squeeze(1)

    def mha(self, q, k, v, layout, meta, softmax_scale):
        return _ragged_mha(q, k, v, layout, softmax_scale)

    def indexer_topk(self, q, weights, k_cache, layout, meta, topk):
        block_table, seqlens = self._paging(layout)
        idx = ops.indexer_topk(q.unsqueeze(1), weights.unsqueeze(1), k_cache, block_table, seqlens, topk,
                               backend=self.kernel_backend)
        return idx.squeeze(1)

    def sparse_mla(self, q, kv_cache, indices, layout, meta, softmax_scale, head_dim_v):
        out, _ = ops.sparse_mla(q.unsqueeze(1), kv_cache, indices.unsqueeze(1), softmax_scale,
                                head_dim_v=head_dim_v, backend=self.kernel_backend)
        return out.squeeze(1)
