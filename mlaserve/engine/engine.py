"""Engine: the synchronous core. `step()` = schedule, run the model, sample, detokenize, stop.

    engine = Engine(EngineConfig(model_path=..., device="cpu"))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():      # RequestOutput deltas of the requests this step touched
            ...

Not thread-safe: one thread owns an Engine (AsyncEngine runs it in its own thread).
"""

import weakref

import torch

from mlaserve.engine.config import EngineConfig
from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.kv_manager import KVManager
from mlaserve.engine.kv_pool import KVPool
from mlaserve.engine.model_runner import ModelRunner, StepLogits
from mlaserve.engine.request import Request, RequestOutput, RequestStatus
from mlaserve.engine.sampler import Sampler, SampleRow
from mlaserve.engine.sampling_params import SamplingParams
from mlaserve.engine.scheduler import ScheduledBatch, Scheduler

CPU_KV_BUDGET_BYTES = 256 << 20   # default pool on the CPU, where there is no memory fraction to take
CPU_MAX_DEFAULT_PAGES = 1024


class Engine:
    """`model` / `tokenizer`: pass objects to skip loading from `config.model_path` (tests, tools).
    Without a tokenizer there is no text: new_text stays "" and stop strings are refused.
    With config.tp_size > 1 the worker ranks are spawned here (engine/tp.py) and stopped by
    `shutdown()` (or when the Engine is collected, or at exit); the model must come from model_path."""

    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        self.tp_workers = None
        try:
            self._setup(config, model, tokenizer)
        except BaseException:
            self.shutdown()      # no worker outlives a failed start
            raise

    def _setup(self, config: EngineConfig, model, tokenizer) -> None:
        self.config = config
        device = config.torch_device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)     # kernels launch on the current device
        if config.tp_size > 1 and model is not None:
            raise ValueError(f"tp_size {config.tp_size} loads each rank's shard from model_path; "
                             "a model object cannot be given")
        if model is None:
            if config.model_path is None:
                raise ValueError("EngineConfig.model_path is required when no model object is given")
            from mlaserve.models import load_model, load_tokenizer
            from mlaserve.models.config import ModelConfig
            from mlaserve.models.parallel import SINGLE, check_divisible
            parallel = SINGLE
            if config.tp_size > 1:
                # refuse indivisible shapes before any process is spawned
                check_divisible(ModelConfig.from_pretrained(config.model_path), config.tp_size)
                from mlaserve.engine.tp import TPWorkers
                self.tp_workers = TPWorkers.start(config)
                self._finalizer = weakref.finalize(self, self.tp_workers.shutdown)
                parallel = self.tp_workers.parallel
            model = load_model(config.model_path, device=device, dtype=config.torch_dtype, parallel=parallel)
            if tokenizer is None:
                tokenizer = load_tokenizer(config.tokenizer_path or config.model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.config
        self.eos_token_ids = set(model.config.eos_token_ids or [])
        self.vocab_size = model.config.vocab_size

        spec = model.kv_pool_spec()
        num_pages = config.num_pages or self._default_num_pages(spec)
        self.kv_pool = KVPool(**spec, num_pages=num_pages, page_size=config.page_size, dtype=config.torch_dtype,
                              device=device, kv_cache_dtype=config.kv_cache_dtype)
        self.runner = ModelRunner(model, self.kv_pool, config.attention_backend, config.nsa_prefill_backend,
                                  config.nsa_decode_backend, config.kv_cache_dtype, device, self.tp_workers)
        if self.tp_workers is not None:
            self.tp_workers.init_kv(num_pages)
        self.kv = KVManager(self.kv_pool.allocator, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_running_requests, config.chunked_prefill_size)
        self.sampler = Sampler(device, config.seed)

        model_ctx = model.config.max_position_embeddings
        if config.context_length is not None and config.context_length > model_ctx:
            raise ValueError(f"context_length {config.context_length} exceeds the model's "
                             f"max_position_embeddings {model_ctx}")
        self.context_length = config.context_length or model_ctx
        # a sequence must fit the pool on its own, or preemption could never make room for it
        self.max_seq_len = min(self.context_length, self.kv.capacity_pages * config.page_size)

        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (a no-op without them); the engine cannot step afterwards."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    def _default_num_pages(self, spec: dict) -> int:
        cfg = self.config
        per_page = KVPool.bytes_per_page(**spec, page_size=cfg.page_size, dtype=cfg.torch_dtype,
                                         kv_cache_dtype=cfg.kv_cache_dtype)
        if cfg.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(cfg.torch_device)
            pages = int(free * cfg.mem_fraction_static) // per_page
            if pages < 2:
                raise ValueError(f"mem_fraction_static={cfg.mem_fraction_static} of {free / 2**30:.2f} GiB free "
                                 f"leaves room for {pages} KV pages of {per_page} bytes; need at least 2")
            return pages
        return max(2, min(CPU_MAX_DEFAULT_PAGES, CPU_KV_BUDGET_BYTES // per_page))

    # -- requests --
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if this request could never run. Reads only fixed state: thread-safe."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size}); got {bad[:5]}")
        n = len(prompt_token_ids)
        if n + 1 > self.max_seq_len:
            where = (f"the context length {self.context_length}" if self.max_seq_len == self.context_length
                     else f"the KV pool ({self.kv.capacity_pages} pages of {self.config.page_size} tokens)")
            raise ValueError(f"a prompt of {n} tokens plus one generated token does not fit {where}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs={params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        bad = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary of {self.vocab_size}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        params = SamplingParams() if params is None else params
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params.skip_special_tokens,
                                           params.stop_strings)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.config.torch_device).manual_seed(params.seed)
        req = Request(request_id, list(prompt_token_ids), params, detok, generator)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its pages; the next step reports it with finish_reason "abort".
        False when the id is unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # -- the step --
    def step(self) -> list[RequestOutput]:
        outputs = [r.take_output() for r in self._aborted]
        self._aborted.clear()
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        logits = self.runner.run(batch)
        self.num_steps += 1
        return outputs + self._process(batch, logits)

    def _process(self, batch: ScheduledBatch, logits: StepLogits) -> list[RequestOutput]:
        reqs = batch.requests
        for i, (r, e) in enumerate(zip(reqs, batch.extend_lens)):
            if batch.prefix_lens[i] < r.prompt_len:
                self.num_prompt_tokens += min(e, r.prompt_len - batch.prefix_lens[i])
            r.num_computed += e
            if i in logits.prompt_logits:
                first, rows = logits.prompt_logits[i]
                targets = torch.tensor(r.tokens[first + 1:first + 1 + rows.shape[0]], device=rows.device)
                lp = torch.log_softmax(rows.float(), dim=-1).gather(1, targets[:, None])[:, 0]
                r.prompt_logprobs.extend(lp.tolist())
            self.kv.cache_computed(r)

        if logits.sample_rows:
            rows = [self._sample_row(reqs[i]) for i in logits.sample_rows]
            result = self.sampler(logits.sample_logits, rows)
            for k, i in enumerate(logits.sample_rows):
                self._append_token(reqs[i], result.token_ids[k], result.logprobs[k], result.top_logprobs[k])

        outputs = []
        for r in reqs:
            ready_prompt_lp = (r.params.prompt_logprobs and not r.prompt_logprobs_reported
                               and not r.wants_prompt_logprobs)
            if r.pending_token_ids or r.is_finished or ready_prompt_lp:
                outputs.append(r.take_output())
        return outputs

    def _sample_row(self, r: Request) -> SampleRow:
        banned = []
        if r.num_output_tokens < r.params.min_tokens:
            banned = sorted((set() if r.params.ignore_eos else self.eos_token_ids) | set(r.params.stop_token_ids or []))
        return SampleRow(r.params, r.generator, banned)

    def _append_token(self, r: Request, token: int, logprob: float | None, top: dict | None) -> None:
        r.tokens.append(token)
        r.pending_token_ids.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
            r.top_logprobs.append(top)
            r.pending_logprobs.append(logprob)
            r.pending_top_logprobs.append(top)
        self.num_generated_tokens += 1
        p = r.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in (p.stop_token_ids or ()):
            # the stop token's text is not part of the output
            self._finish(r, "stop", stop_reason=token)
            return
        if r.detokenizer is not None:
            delta, stop = r.detokenizer.add(token)
            r.pending_text.append(delta)
            if stop is not None:
                self._finish(r, "stop", stop_reason=stop, flush=False)
                return
        if (p.max_tokens is not None and r.num_output_tokens >= p.max_tokens) or len(r.tokens) >= self.max_seq_len:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, stop_reason=None, flush: bool = True) -> None:
        if flush and r.detokenizer is not None:
            r.pending_text.append(r.detokenizer.flush())
        self.scheduler.remove(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        r.stop_reason = stop_reason
        del self._requests[r.request_id]

    # -- observability --
    def num_free_pages(self) -> int:
        """Free pages plus cached pages no request uses (reclaimable on demand)."""
        return self.kv.num_available

    def leaked_pages(self) -> list[int]:
        """Pages held by nobody but not free. Meaningful when idle (no unfinished request)."""
        if self.has_unfinished():
            raise RuntimeError("leaked_pages() is only meaningful when the engine is idle")
        return self.kv.leaked_pages()

    def stats(self) -> dict:
        cache = self.kv.cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_used": self.kv.num_used,
            "pages_total": self.kv.capacity_pages,
            "pages_free": self.kv.num_available,
            "pages_cached": cache.num_cached if cache else 0,
            "page_size": self.config.page_size,
            "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prompt_tokens_computed": self.num_prompt_tokens,
            "tokens_generated": self.num_generated_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        }
