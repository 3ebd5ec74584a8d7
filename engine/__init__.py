"""pdserve.engine: one model's continuous batching engine, which every worker role and the
offline ``LLM`` run. Its folders, one concept each:

- at the top, what every part reads and the step over them: ``config`` (``EngineConfig``),
  ``sequence`` (one request's state), ``parts`` (what an engine is built from),
  ``llm_engine`` (``LLMEngine``: add_request / step / abort), ``engine_loop`` (the engine's
  thread and its step bound), ``worker_stats`` (what a worker reports of it), ``llm`` (the
  offline ``LLM``, ``pdserve.LLM``);
- ``step/``: the scheduler and its policies, the model runner with its persistent decode rows
  and CUDA graphs, the step hooks, and the output stage (text stage, detokenizer);
- ``kv_cache/``: the block manager and its prefix hashes, the KV events, int8 KV scales;
- ``sampling/``: the sampler, its filters, the seeded uniforms, the rejection sampler;
- ``speculation/``: the speculative config and the ``Speculator``;
- ``tensor_parallel/``: the rank group and its follower processes;
- ``capacity/``: memory planning, the budget check, the roofline.
"""
