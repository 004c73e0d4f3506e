"""A tiny fake model with the real model interface, for engine tests that need no weights.

It writes [token id, position] of every new token into the paged KV cache, then reads each
token's whole context back from the cache through the block table and checks the stored
positions, so any paging or prefix-cache mistake (a wrong page, a stale or unwritten slot —
tests poison the pool with NaN) raises or changes the output. The next token is a hash of
the context read back: greedy outputs are a deterministic function of the full sequence.
"""

from dataclasses import dataclass, field

import torch

from mlaserve.attention.base import BackendConfig


@dataclass
class FakeConfig:
    vocab_size: int = 101
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=lambda: [0])
    is_dsa: bool = False
    index_topk: int | None = None


def next_token(context: list[int], vocab_size: int) -> int:
    """What the fake model predicts after `context` (pure python, for expected values)."""
    h = sum((t + 1) * (j + 1) * 31 for j, t in enumerate(context)) + 7 * len(context)
    return h % vocab_size


class FakeModel:
    def __init__(self, vocab_size: int = 101, max_position_embeddings: int = 4096, eos_token_ids=(0,)):
        self.config = FakeConfig(vocab_size, max_position_embeddings, list(eos_token_ids))
        self.num_forward_tokens = 0
        self.steps: list[tuple[str, list[int], list[int]]] = []   # (mode, prefix_lens, extend_lens)

    def kv_pool_spec(self) -> dict:
        return dict(num_layers=1, kv_lora_rank=2, rope_dim=2, index_head_dim=None)

    def backend_config(self, kv_cache_dtype, device, page_size: int = 64) -> BackendConfig:
        return BackendConfig(num_heads=1, kv_lora_rank=2, qk_rope_head_dim=2, dtype=torch.float32,
                             kv_cache_dtype=kv_cache_dtype, device=torch.device(device), page_size=page_size)

    def forward(self, fb) -> torch.Tensor:
        """-> [T, 1]: the predicted next token of each new token's context, as a float."""
        layout = fb.layout
        self.steps.append((layout.mode.value, list(layout.prefix_lens), list(layout.extend_lens)))
        self.num_forward_tokens += layout.num_tokens
        ids = fb.input_ids.double()
        ckv = torch.stack([ids, layout.positions.double()], dim=-1)
        fb.kv_cache.store_kv(0, layout.slot_mapping, ckv, torch.zeros_like(ckv))
        out = []
        ps = layout.page_size
        for p, e, table in zip(layout.prefix_lens, layout.extend_lens, layout.block_tables):
            n = p + e
            pos = torch.arange(n)
            slots = torch.tensor(table, dtype=torch.int64)[pos // ps] * ps + pos % ps
            rows = fb.kv_cache.gather_kv(0, slots).double()             # [n, 4]
            if not torch.equal(rows[:, 1], pos.double()):
                raise RuntimeError(f"KV cache holds positions {rows[:, 1].tolist()}, expected 0..{n - 1}")
            toks = rows[:, 0].long().tolist()
            for j in range(p, n):
                out.append(float(next_token(toks[:j + 1], self.config.vocab_size)))
        return torch.tensor(out, dtype=torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, 1] -> float32 [N, vocab]: peaked at the predicted token, a smooth tail elsewhere."""
        target = hidden[:, 0].long()
        vocab = torch.arange(self.config.vocab_size)
        dist = (vocab[None, :] - target[:, None]).abs().float()
        return -0.5 * dist


def fake_greedy(prompt: list[int], max_tokens: int, vocab_size: int = 101, eos: int | None = 0) -> list[int]:
    """The fake model's greedy continuation, computed without the engine."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(seq, vocab_size)
        out.append(t)
        seq.append(t)
        if t == eos:
            break
    return out


class ByteTokenizer:
    """A byte-level tokenizer: ids 0..255 are bytes, 256+ are multi-byte pieces; decode is
    lossy UTF-8 like HF byte-level BPE (a split character decodes to U+FFFD)."""

    def __init__(self, pieces=("hello", " world", "STOP", "é", "你好", "<eos>")):
        self.pieces = [p.encode() for p in pieces]
        self.special_ids = {256 + i for i, p in enumerate(pieces) if p.startswith("<")}

    def token_bytes(self, t: int) -> bytes:
        return bytes([t]) if t < 256 else self.pieces[t - 256]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        data = b"".join(self.token_bytes(t) for t in ids if not (skip_special_tokens and t in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def encode_bytes(self, text: str) -> list[int]:
        return list(text.encode())


def make_engine(page_size=4, num_pages=64, chunked_prefill_size=None, enable_prefix_caching=True,
                max_running_requests=256, context_length=None, vocab_size=101, max_position_embeddings=4096,
                tokenizer=None, eos_token_ids=(0,)):
    """An Engine over FakeModel on the CPU, its KV pool poisoned with NaN."""
    from mlaserve.engine.config import EngineConfig
    from mlaserve.engine.engine import Engine
    model = FakeModel(vocab_size, max_position_embeddings, eos_token_ids)
    config = EngineConfig(device="cpu", attention_backend="torch", page_size=page_size, num_pages=num_pages,
                          chunked_prefill_size=chunked_prefill_size, enable_prefix_caching=enable_prefix_caching,
                          max_running_requests=max_running_requests, context_length=context_length)
    engine = Engine(config, model=model, tokenizer=tokenizer)
    engine.kv_pool.kv(0).fill_(float("nan"))
    return engine, model


def run_to_end(engine, on_step=None) -> dict:
    """Step until idle -> {request_id: merged outputs} with token_ids, text, logprobs, finish_reason ..."""
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, dict(token_ids=[], text="", logprobs=[], top_logprobs=[],
                                                          prompt_logprobs=None, finish_reason=None, outputs=0))
            r["token_ids"] += out.new_token_ids
            r["text"] += out.new_text
            r["logprobs"] += out.new_logprobs
            r["top_logprobs"] += out.new_top_logprobs
            r["outputs"] += 1
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                r["finish_reason"] = out.finish_reason
                r["stop_reason"] = out.stop_reason
                r["num_cached_tokens"] = out.num_cached_tokens
        if on_step is not None:
            on_step(engine)
    return results
