"""`auto`: for each step, the backend measured fastest for its shape, among those that run here.

The primary backend runs everything no decode peer takes: `cutedsl_mla` where it can run (Hopper, the
CuTe DSL installed, page 64), else `triton` on a GPU, `torch` on the CPU (where Triton would only run
through its interpreter). Decode peers take the DECODE steps where they measured faster than that
primary (DECODE_RULES). Measured on the H200, CUDA-graph timing, page 64, all three kernels in one run
(bench/results/h200-20261130-e49dd98-rows128.json, h200-20261130-0a09248-cutedsl.json.gz; earlier runs:
h200-20261130-266e5ce-cutedsl.json.gz, h200-20261130-a395c1d-cutedsl.json.gz, h200-20261130-d9dab88.json.gz):
- against `cutedsl_mla`, FlashInfer's fa3 MLA no longer wins anywhere by more than noise: at 128 query rows
  per request in small batches (s_k 32768) it took b 4 by 7-20% until the split combine loaded all splits at
  once (bench/NOTES.md item 46); since the seesaw's speculative softmax (NOTES 98; h200-20261201-78a6638-dense-
  cutedsl-triton-flashinfer.json.gz) b 1/4/16 are 1.26/1.01/1.03x (FlashInfer's time / cutedsl's), b 128 h 128
  1.03-1.08x at s_q 1 and 1.02-1.06x at s_q 2 (4k-32k), h 64 s_q 2 1.04-1.13x, every other shape 1.02-1.20x, so
  cutedsl keeps every step; FlashInfer cannot read the FP8 cache;
- against `cutedsl_mla`, Triton's keys-on-M kernel takes steps of up to 16 rows over 16-bit caches: level or
  ahead at h16 (b 128: 0.99-1.04x; b 1/4/16 level; h200-20261201-e1ffa47-dirty-dense-cutedsl-triton-
  flashinfer.json.gz); over the FP8 cache the CuTe DSL's FP8-MMA kernel has pulled ahead (b128 h16 1.12-1.18x,
  b 4/16 1.06/1.15x; b 1 0.93x; that run against Triton's of h200-20261201-291a5c8-dense-triton-flashinfer.json.gz),
  so it keeps them; from 17 rows the CuTe DSL kernel is ahead or level (h32 bf16 0.94-1.07x against Triton's
  64-row seesaw, FP8 1.05-1.11x; h64/h128: 1.00-1.08x bf16);
- against `triton` (a primary only where the CuTe DSL cannot run), FlashInfer wins from 65 rows on, by less
  than before Triton's 64-row kernel became a seesaw (h200-20261201-e1ffa47-dirty-dense-cutedsl-triton-
  flashinfer.json.gz, bench/NOTES.md item 80): Triton at 0.96-0.97x at h 128 s_q 1, 0.94-1.00x at 256 rows and
  0.95-0.98x at h 64 s_q 2 (128 rows); up to 64 rows Triton keeps the steps: 1.04-1.11x FlashInfer at h 16
  (b 128; 1.03-1.95x at b 16/4/1), 1.01-1.11x at h 32 (32 rows, the seesaw since bench/NOTES.md 83; h200-
  20261201-97072e9-dense-triton-flashinfer.json.gz) and 0.99-1.09x at h 64 (64 rows: 1.03-1.12x at h 32 s_q 2); the
  CuTe DSL kernel would take the steps from 17 rows. With variable lengths (uniform in [s/2,
  3s/2]) and Triton's grids taking requests longest first, Triton is ahead at 64-256 rows (1.08-1.31x): the rule
  follows the fixed-length shapes;
- with variable lengths at <= 64 rows, both backends' kernels split in two where the step's host lengths leave
  SMs idle (mla_decode_plan.balanced_splits, bench/NOTES.md 86, 104-105) and take the halves longest first:
  Triton's time / the CuTe DSL's 0.97-1.22x (b 128, h 16-64, s_q 1-2, s_k 4k-32k, bf16 and FP8; 0.97-0.98x only
  at FP8 h 32 s_q 1 4k/8k and FP8 h 16 s_q 2 4k/8k; h200-20261201-240a4d9-dense-var-cutedsl-triton-
  flashinfer.json.gz), so the CuTe DSL keeps them (before 240a4d9 its grids ran in request order, unsplit, at
  0.75-0.93x Triton's speed, and Triton took those steps); from 128 rows the CuTe DSL stays ahead.
Peers have no DSA kernels; FlashInfer has no FP8 path here: EXTEND steps and DSA layers stay with the primary.
"""
from dataclasses import dataclass

from mlaserve.attention.base import AttentionBackend, BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode


@dataclass(frozen=True)
class DecodeRule:
    """The DECODE steps a peer takes from a primary: those with `min_rows` .. `max_rows` query rows (heads x new
    tokens) per request and at most `max_batch` requests (None: no bound), over caches of `kv` ("16bit" or "fp8";
    None: either)."""
    min_rows: int
    max_batch: int | None = None
    max_rows: int | None = None
    kv: str | None = None

    def applies_to(self, config: BackendConfig) -> bool:
        return self.kv is None or self.kv == ("fp8" if config.kv_cache_dtype == "fp8_e4m3" else "16bit")

    def takes(self, rows: int, batch: int) -> bool:
        return (rows >= self.min_rows and (self.max_rows is None or rows <= self.max_rows)
                and (self.max_batch is None or batch <= self.max_batch))


# primary name -> {peer name: its rules (a step is the peer's if any rule takes it)}, from the measurements in the
# module docstring
DECODE_RULES: dict[str, dict[str, tuple[DecodeRule, ...]]] = {
    "cutedsl_mla": {"triton": (DecodeRule(min_rows=1, max_rows=16, kv="16bit"),)},
    "triton": {"flashinfer": (DecodeRule(min_rows=65),), "cutedsl_mla": (DecodeRule(min_rows=17),)},
}


@dataclass
class AutoMeta:
    backend: AttentionBackend   # the backend chosen for this step
    inner: object               # what its plan(layout) returned


class AutoBackend(AttentionBackend):
    name = "auto"

    def __init__(self, config: BackendConfig, primary: AttentionBackend,
                 decode_peers: tuple[AttentionBackend, ...] = ()):
        """primary: runs everything the peers do not; decode_peers: backends that can run this config's
        DECODE steps here, in order of preference; each takes the steps its DECODE_RULES entry names."""
        super().__init__(config)
        self.primary = primary
        rules = {name: tuple(r for r in peer_rules if r.applies_to(config))
                 for name, peer_rules in DECODE_RULES.get(primary.name, {}).items()}
        self.decode_peers = tuple(p for p in decode_peers if rules.get(p.name))
        self._rules = [(p, rule) for p in self.decode_peers for rule in rules[p.name]]

    def choose(self, layout: BatchLayout) -> AttentionBackend:
        if layout.mode is ForwardMode.DECODE:
            rows = self.config.num_heads * max(layout.extend_lens, default=1)
            for peer, rule in self._rules:
                if rule.takes(rows, layout.batch_size):
                    return peer
        return self.primary

    def plan(self, layout: BatchLayout) -> AutoMeta:
        backend = self.choose(layout)
        return AutoMeta(backend, backend.plan(layout))

    def extend_uses_mha(self, layout: BatchLayout) -> bool:
        return self.choose(layout).extend_uses_mha(layout)

    def mla(self, q, kv_cache, layout, meta: AutoMeta, softmax_scale, head_dim_v):
        return meta.backend.mla(q, kv_cache, layout, meta.inner, softmax_scale, head_dim_v)

    def mha(self, q, k, v, layout, meta: AutoMeta, softmax_scale):
        return meta.backend.mha(q, k, v, layout, meta.inner, softmax_scale)

    def indexer_topk(self, q, weights, k_cache, layout, meta: AutoMeta, topk):
        return self._dsa(meta).indexer_topk(q, weights, k_cache, layout, meta.inner, topk)

    def sparse_mla(self, q, kv_cache, indices, layout, meta: AutoMeta, softmax_scale, head_dim_v):
        return self._dsa(meta).sparse_mla(q, kv_cache, indices, layout, meta.inner, softmax_scale, head_dim_v)

    def _dsa(self, meta: AutoMeta) -> AttentionBackend:
        # the registry builds DSA autos without a decode peer, so every step's choice is the primary
        if meta.backend is not self.primary:
            raise RuntimeError(f"auto chose {meta.backend.name!r} for this step, which has no DSA kernels")
        return self.primary
