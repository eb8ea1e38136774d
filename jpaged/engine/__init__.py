"""The serving engine, one module per job (internal; the public names are re-exported from
`jpaged`: `jpaged.LLM`, `jpaged.SamplingParams`, `jpaged.BeamSearchParams`,
`jpaged.RequestOutput`, `jpaged.CompletionOutput`, `jpaged.default_compiler_options`).

- `llm`: the `LLM` facade; builds the parts below and drives one step at a time.
- `requests`: `Request` and `Sequence` records.
- `scheduler`: continuous batching; returns each step's `StepPlan` as data.
- `kv_manager`: the allocator, the device pool and the host swap space; runs a plan's page
  operations on the device.
- `buckets`: the shape buckets of the step programs, and the programs a configuration needs.
- `batches`: the fixed-shape step inputs.
- `runner`: the jitted step programs (single step, decode loop).
- `step`: one planned step as one device call.
- `decode_chain`: chains of multi-step decode loops.
- `appender`: sampled tokens into sequences (stops, forks, beam steps, prefix commits).
- `sampling`, `beam`, `detokenize`, `outputs`: sampling, beam search selection,
  incremental detokenizing, the result types.
- `model_setup`, `warmup`, `compile_cache`, `counters`: construction helpers, compiling
  every program (in parallel), the persistent compilation cache, the stats counters.
"""
