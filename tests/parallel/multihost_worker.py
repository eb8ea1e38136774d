"""One process of a 2-process ``jax.distributed`` job on CPU (run by
``tests/parallel/test_parallel_mesh.py``; not a test module).

``python tests/parallel/multihost_worker.py PROCESS_ID PORT OUT.json [--swap]``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``: 4 devices over 2 processes, one model
split over all 4 (TP = 4: half of the heads on each host). Only the leader knows the prompts;
it broadcasts them, and both processes run the engine in lockstep (BUILD.md's loop). Each
process writes the tokens it got to OUT.json.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
swap = "--swap" in sys.argv
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import jpaged  # noqa: E402
from jpaged.parallel import broadcast_from_leader, is_leader  # noqa: E402

with open("tests/goldens/llama2.json") as f:
    golden = json.load(f)
engine = dict(page_size=8, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32,
              debug=True, swap_space=8 << 20,  # tests/_engine_helpers.py's SWAP_SPACE
              tensor_parallel_size=jax.device_count())  # fmt: skip
# With --swap the pool (10 pages) is too small for three 51-token sequences: swap preemption,
# each host keeping its own devices' heads of the swapped pages.
engine |= dict(num_pages=10, watermark=0.0, preemption_mode="swap") if swap else dict(num_pages=64)
llm = jpaged.LLM("tests/checkpoints/llama2", **engine)

greedy = jpaged.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
waiting = [(f"r{i}", golden["prompt_ids"], greedy) for i in range(3)] if is_leader() else None
tokens: dict[str, list[int]] = {}
while True:
    # The leader hands out one request per step (as a server would, as they arrive).
    new = broadcast_from_leader(waiting[:1] if waiting else [])
    if is_leader():
        del waiting[:1]
    for request_id, prompt, params in new:
        llm.add_request(prompt, params, request_id=request_id)
    for out in llm.step():
        if out.finished:
            tokens[out.request_id] = out.outputs[0].token_ids
    if not broadcast_from_leader(llm.has_unfinished_requests() or bool(waiting)):
        break
stats = llm.stats()
with open(out_path, "w") as f:
    json.dump({"tokens": tokens, "golden": golden["greedy"]["tokens"],
               "devices": jax.device_count(), "local": jax.local_device_count(),
               "preemptions_swap": stats["preemptions_swap"]}, f)  # fmt: skip
