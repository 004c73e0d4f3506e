"""The `triton` attention backend: mlaserve's Triton kernels, planned on the host, decode capturable in CUDA graphs.

`plan(layout)` does every host-side, data-dependent thing once per step (how the step's tokens map
onto the decode kernel's (b, s_q) rows, the KV split count, the split workspace); `mla(...)` only
launches. The same plan serves all layers of the step.

EXTEND steps: the absorbed kernel runs them when the requests bring few new tokens (each request
as one (b, s_q) row block when all bring the same count <= 8 — speculative verification — else each
token as its own s_q = 1 row over its request's cache); long extends take the MHA form through
torch's scaled_dot_product_attention. Why the switch (`extend_uses_mha`): the absorbed form costs
(2 * kv_lora_rank + rope) = 1088 multiply-adds per head per (query, key) pair against the MHA
form's nope + rope + v = 320 (DeepSeek), while the MHA form first expands every context key through
kv_b_proj (h * 2 * 128 * 512 multiply-adds): it wins once a key is attended by more than ~170
queries, which `mha_min_extend` (mean new tokens per request) approximates.
"""

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlaserve import ops
from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode
from mlaserve.kernels import fp8_format

if TYPE_CHECKING:
    from mlaserve.kernels.triton.mla_decode import MLADecodePlan

# Uniform extends up to this many tokens per request run as one (b, s_q) block of query rows.
_MAX_PACKED_S_Q = 8


@dataclass
class TritonMeta:
    """What `TritonBackend.plan` hands to every layer of one step.

    The step's T new tokens are viewed as [b, s_q] query rows: per request in DECODE (s_q = 1) and
    uniform short EXTEND (s_q = extend length), per token in other EXTEND steps (b = T, s_q = 1).
    """
    s_q: int
    block_table: torch.Tensor    # on device, int32 [b, max_pages]
    seqlens: torch.Tensor        # on device, int32 [b]: cached tokens of each row block, its s_q new ones included
    decode_plan: "MLADecodePlan"  # config, split count and workspace of the decode kernel


class TritonBackend(AttentionBackend):
    """Dense MLA through mlaserve's Triton decode kernel; DSA through ops.indexer_topk / ops.sparse_mla."""
    name = "triton"
    kernel_backend = "triton"           # the dense decode kernel's ops backend
    indexer_kernel_backend = "triton"   # the DSA indexer's
    sparse_kernel_backend = "triton"    # sparse MLA's
    supports_cuda_graph = True

    @staticmethod
    def unavailable_reason(config: BackendConfig) -> str | None:
        from mlaserve.ops.registry import BACKENDS
        reason = BACKENDS["triton"].unavailable_reason(torch.device(config.device))
        if reason is not None:
            return reason
        if torch.device(config.device).type == "cpu" and config.dtype == torch.bfloat16:
            return "Triton's CPU interpreter computes tl.dot on bfloat16 wrongly (triton#11584); use fp16/fp32"
        if config.kv_cache_dtype == "fp8_e4m3":
            if (config.kv_lora_rank, config.qk_rope_head_dim) != (fp8_format.KV_LORA_RANK, fp8_format.ROPE_DIM):
                return (f"the FP8 KV cache needs kv_lora_rank={fp8_format.KV_LORA_RANK} and qk_rope_head_dim="
                        f"{fp8_format.ROPE_DIM}, got {config.kv_lora_rank} and {config.qk_rope_head_dim}")
            device = torch.device(config.device)
            if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
                return "the FP8 KV cache needs e4m3 conversions: an NVIDIA GPU of compute capability >= 8.9"
        return None

    def __init__(self, config: BackendConfig, mha_min_extend: int = 128):
        super().__init__(config)
        reason = self.unavailable_reason(config)
        if reason is not None:
            raise ValueError(f"attention backend 'triton' cannot run here: {reason}")
        if mha_min_extend < 1:
            raise ValueError(f"mha_min_extend must be >= 1, got {mha_min_extend}")
        self.mha_min_extend = mha_min_extend
        # imported here, not at module level, so that the registry can say why triton is unusable
        self._decode = importlib.import_module("mlaserve.kernels.triton.mla_decode")
        self._graph = None   # _GraphBuffers after init_cuda_graph

    # -- planning --
    def extend_uses_mha(self, layout: BatchLayout) -> bool:
        return layout.num_tokens >= self.mha_min_extend * layout.batch_size

    def _rows(self, layout: BatchLayout) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(s_q, block_table, seqlens) viewing the step's tokens as [b, s_q] query rows."""
        lens = set(layout.extend_lens)
        if layout.mode is ForwardMode.DECODE or (len(lens) == 1 and max(lens) <= _MAX_PACKED_S_Q):
            return max(lens, default=1), layout.block_table, layout.cache_seqlens
        return 1, layout.token_block_table, layout.token_seqlens

    def _plan_kernel(self, b: int, s_q: int, max_pages: int, page_size: int, workspace=None, host_seqlens=None):
        return self._decode.plan_mla_decode(
            b, s_q, self.config.num_heads, self.config.kv_lora_rank, max_pages, page_size,
            self.config.kv_cache_dtype == "fp8_e4m3", self.config.device, workspace=workspace,
            seqlens=host_seqlens)

    def plan(self, layout: BatchLayout) -> TritonMeta:
        s_q, block_table, seqlens = self._rows(layout)
        # per-request rows: the step's lengths on the host let the kernel's splits balance them (a plan made here
        # serves this step only; CUDA-graph plans stay shape-only)
        host = layout.seq_lens if block_table is layout.block_table else None
        decode_plan = self._plan_kernel(block_table.shape[0], s_q, block_table.shape[1], layout.page_size,
                                        host_seqlens=host)
        return TritonMeta(s_q, block_table, seqlens, decode_plan)

    # -- dense MLA --
    def mla(self, q, kv_cache, layout, meta: TritonMeta, softmax_scale, head_dim_v):
        """q [T, h, d_qk] -> o_lat [T, h, head_dim_v] in q's dtype."""
        b = meta.block_table.shape[0]
        out, _ = ops.mla_decode(q.view(b, meta.s_q, *q.shape[1:]), kv_cache, meta.block_table, meta.seqlens,
                                softmax_scale, causal=True, head_dim_v=head_dim_v, backend=self.kernel_backend,
                                plan=meta.decode_plan)
        return out.view(q.shape[0], q.shape[1], head_dim_v)

    def mha(self, q, k, v, layout, meta, softmax_scale):
        """Causal MHA per request through scaled_dot_product_attention (FlashAttention on GPUs).

        q [T, h, d_qk]; k [Tk, h, d_qk]; v [Tk, h, d_v] laid out by layout.cu_seqlens_k -> [T, h, d_v].
        """
        from torch.nn.attention.bias import causal_lower_right
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        q_start = k_start = 0
        for prefix, ext in zip(layout.prefix_lens, layout.extend_lens):
            n = prefix + ext
            qi = q[q_start:q_start + ext].transpose(0, 1)[None]    # [1, h, ext, d_qk]
            ki = k[k_start:k_start + n].transpose(0, 1)[None]      # [1, h, n, d_qk]
            vi = v[k_start:k_start + n].transpose(0, 1)[None]      # [1, h, n, d_v]
            # the new tokens are the last `ext` of the context: causal aligned to the bottom right
            mask = causal_lower_right(ext, n) if prefix else None
            oi = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=not prefix,
                                                                  scale=softmax_scale)
            out[q_start:q_start + ext] = oi[0].transpose(0, 1)
            q_start += ext
            k_start += n
        return out

    # -- DSA --
    def indexer_topk(self, q, weights, k_cache, layout, meta: TritonMeta, topk):
        """q [T, H_I, D_I]; weights float32 [T, H_I] -> int32 [T, topk] slot ids."""
        b = meta.block_table.shape[0]
        idx = ops.indexer_topk(q.view(b, meta.s_q, *q.shape[1:]), weights.view(b, meta.s_q, -1), k_cache,
                               meta.block_table, meta.seqlens, topk, backend=self.indexer_kernel_backend)
        return idx.view(q.shape[0], topk)

    def sparse_mla(self, q, kv_cache, indices, layout, meta, softmax_scale, head_dim_v):
        """q [T, h, d_qk]; indices int32 [T, topk] -> o_lat [T, h, head_dim_v]."""
        out, _ = ops.sparse_mla(q.unsqueeze(1), kv_cache, indices.unsqueeze(1), softmax_scale,
                                head_dim_v=head_dim_v, backend=self.sparse_kernel_backend)
        return out.squeeze(1)

    # -- CUDA graphs (DECODE steps) --
    def init_cuda_graph(self, max_batch_size: int, max_pages: int) -> None:
        """Static paging buffers for decode batches of up to max_batch_size requests x max_pages pages."""
        if max_batch_size < 1 or max_pages < 1:
            raise ValueError(f"max_batch_size and max_pages must be >= 1, got {max_batch_size}, {max_pages}")
        device = self.config.device
        self._graph = _GraphBuffers(
            max_batch_size=max_batch_size, max_pages=max_pages,
            block_table=torch.zeros(max_batch_size, max_pages, dtype=torch.int32, device=device),
            seqlens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
            page_size=None, workspace=None, metas={})

    def plan_for_capture(self, layout: BatchLayout) -> TritonMeta:
        """Writes the layout into the static buffers; the meta returned is the one replays of this batch size use."""
        g = self._check_graph_layout(layout)
        b = layout.batch_size
        if g.workspace is None:
            # sized once, before any capture, for every batch size: captured graphs keep pointing at it
            g.page_size = layout.page_size
            d, h = self._decode, self.config.num_heads
            kv_fp8, device = self.config.kv_cache_dtype == "fp8_e4m3", torch.device(self.config.device)
            need = max(d.workspace_numel(n, h, self.config.kv_lora_rank, d.choose_num_splits(
                n, 1, h, g.max_pages, g.page_size, device,
                d.decode_config(n, 1, h, g.max_pages, g.page_size, kv_fp8, device)))
                       for n in range(1, g.max_batch_size + 1))
            g.workspace = torch.empty(max(need, 1), dtype=torch.float32, device=self.config.device)
        self._copy_into(g, layout)
        if b not in g.metas:
            plan = self._plan_kernel(b, 1, g.max_pages, g.page_size, workspace=g.workspace)
            g.metas[b] = TritonMeta(1, g.block_table[:b], g.seqlens[:b], plan)
        return g.metas[b]

    def plan_for_replay(self, layout: BatchLayout) -> TritonMeta:
        g = self._check_graph_layout(layout)
        if layout.batch_size not in g.metas:
            raise ValueError(f"no CUDA graph was captured for batch size {layout.batch_size}; "
                             f"captured: {sorted(g.metas)}")
        self._copy_into(g, layout)
        return g.metas[layout.batch_size]

    def _check_graph_layout(self, layout: BatchLayout) -> "_GraphBuffers":
        g = self._graph
        if g is None:
            raise ValueError("call init_cuda_graph(max_batch_size, max_pages) before planning for CUDA graphs")
        if layout.mode is not ForwardMode.DECODE:
            raise ValueError(f"CUDA graphs cover DECODE steps only, got {layout.mode}")
        if not 1 <= layout.batch_size <= g.max_batch_size or layout.block_table.shape[1] > g.max_pages:
            raise ValueError(f"decode batch of {layout.batch_size} requests x {layout.block_table.shape[1]} pages "
                             f"exceeds the graph buffers ({g.max_batch_size} x {g.max_pages})")
        if g.page_size is not None and layout.page_size != g.page_size:
            raise ValueError(f"page_size {layout.page_size} differs from the captured {g.page_size}")
        return g

    @staticmethod
    def _copy_into(g: "_GraphBuffers", layout: BatchLayout) -> None:
        b, width = layout.block_table.shape
        g.block_table[:b, :width].copy_(layout.block_table)
        g.seqlens[:b].copy_(layout.cache_seqlens)


@dataclass
class _GraphBuffers:
    max_batch_size: int
    max_pages: int
    block_table: torch.Tensor        # on device, int32 [max_batch_size, max_pages]
    seqlens: torch.Tensor            # on device, int32 [max_batch_size]
    page_size: int | None            # fixed by the first capture
    workspace: torch.Tensor | None   # on device, fp32: the split workspace every captured batch size shares
    metas: dict                      # batch size -> TritonMeta captured for it
