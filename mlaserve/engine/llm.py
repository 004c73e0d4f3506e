"""The offline API: generate for a list of prompts, run to completion on an Engine.

    from mlaserve import LLM, SamplingParams
    llm = LLM("path/to/model", device="cpu", dtype="float32", attention_backend="torch")
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason
"""

from dataclasses import dataclass, field
from itertools import count

from mlaserve.engine.config import EngineConfig
from mlaserve.engine.engine import Engine
from mlaserve.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One prompt's result. logprobs[i] scores token_ids[i] (None when not asked for);
    top_logprobs[i] maps the most likely token ids to logprobs; prompt_logprobs has one entry
    per prompt token, the first None."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class LLM:
    """`dtype`: "float32" | "bfloat16" | "float16" | "auto"; `device`: "cpu" | "cuda" (None: cuda if present).
    Other EngineConfig fields go through `engine_kwargs` (num_pages, chunked_prefill_size,
    enable_prefix_caching, max_running_requests, context_length, nsa_prefill_backend, tp_size, ...).
    With tp_size > 1 call `shutdown()` (or use `with LLM(...) as llm:`) to stop the worker processes.
    A backend that cannot run here raises ValueError now, with the registry's reason."""

    def __init__(self, model_path: str, device: str | None = None, dtype: str = "auto",
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto", page_size: int = 64,
                 **engine_kwargs):
        config = EngineConfig(model_path=model_path, device=device, dtype=dtype, attention_backend=attention_backend,
                              kv_cache_dtype=kv_cache_dtype, page_size=page_size, **engine_kwargs)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """Wrap an existing Engine (e.g. one built around a model object)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.tokenizer = engine.tokenizer
        llm._ids = count()
        return llm

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel worker processes (if any); also done when the LLM is collected."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = False) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs in the order of the prompts."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts (text) or prompt_token_ids")
        texts: list[str | None]
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this engine has none")
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            token_ids = [self.tokenizer(t)["input_ids"] for t in texts]
        else:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            token_ids = [list(p) for p in prompt_token_ids]
            texts = [None] * len(token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(token_ids)
        if len(params) != len(token_ids):
            raise ValueError(f"{len(params)} sampling_params for {len(token_ids)} prompts")
        for ids, p in zip(token_ids, params):
            self.engine.validate(ids, p)

        results: dict[str, CompletionOutput] = {}
        order = []
        for text, ids, p in zip(texts, token_ids, params):
            rid = f"llm-{next(self._ids)}"
            results[rid] = CompletionOutput(rid, text, ids, logprobs=[] if p.logprobs is not None else None,
                                            top_logprobs=[] if p.logprobs is not None else None)
            order.append(rid)
            self.engine.add_request(rid, ids, p)
        bar = _progress(len(order)) if use_tqdm else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None:
                    continue                 # a request of someone else sharing this engine
                res.token_ids += out.new_token_ids
                res.text += out.new_text
                if res.logprobs is not None:
                    res.logprobs += out.new_logprobs
                    res.top_logprobs += out.new_top_logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
                    res.num_cached_tokens = out.num_cached_tokens
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in order]


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
