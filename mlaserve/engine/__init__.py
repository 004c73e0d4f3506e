"""The engine: requests in, tokens out, over a paged latent KV cache.

    config.py          EngineConfig (SGLang's flag names), validated
    sampling_params.py SamplingParams, validated
    request.py         Request (a sequence's state) and RequestOutput (what a step reports)
    kv_pool.py         KVPool + PageAllocator (shared with models/attention)
    prefix_cache.py    full-page prefix sharing with refcounts and LRU eviction
    kv_manager.py      pages for requests: admission with cache hits, growth, release
    scheduler.py       continuous batching: EXTEND / DECODE steps, chunked prefill, preemption
    model_runner.py    a scheduled batch -> BatchLayout, backend plans, ForwardBatch -> logits
    sampler.py         greedy / temperature / top-k / top-p, per-request seeds, logprobs
    detokenizer.py     incremental text with stop strings
    engine.py          Engine: the synchronous step loop
    async_engine.py    AsyncEngine: the step loop in a background thread, for the server
    llm.py             LLM: the offline API
    generate_cli.py    `mlaserve generate`

Submodules are imported where used, so `import mlaserve.engine.kv_pool` stays light.
"""
