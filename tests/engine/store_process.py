"""One process of the executable-store tests (``test_executable_store.py`` runs it fresh, so
that what one process stored is loaded by another, as in use).

``python tests/engine/store_process.py DIR run``: an engine warmed up with its cache in DIR,
then greedy tokens, then those of an engine rebuilt over the same model without a warm-up;
prints a JSON line: programs loaded, step-program traces, tokens.
``... DIR keys``: after a warm-up from DIR, warm-ups of the decode and ragged steps under
another jpaged source, JAX flag and compiler options, then without them, then the whole
warm-up again; prints how many programs each loaded.
``... DIR badrun``: as ``run``, but the first decode loop loaded fails when run.
``... DIR mesh``: as ``run``, on a 2 x 2 ("data", "model") mesh of 4 CPU devices.
"""

import json
import sys

sys.path.insert(0, "tests")

import jax
from _engine_helpers import make_llm, random_prompts

import jpaged
from jpaged.engine import executable_store, runner

PROMPTS = random_prompts(41, (5, 13, 1, 22))
GREEDY = jpaged.SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)


def warm(directory, mesh: bool = False, **kw):
    if mesh:  # as tests/parallel/mesh_cases.py builds its engines
        from jpaged.parallel import make_mesh

        llm = jpaged.LLM("tests/checkpoints/llama2", mesh=make_mesh(2, 2), page_size=8,
                         num_pages=64, max_num_seqs=8, max_model_len=64,
                         max_num_batched_tokens=32, compilation_cache=directory)  # fmt: skip
    else:
        kw = {"num_decode_steps": 2, "max_num_seqs": 6, "compilation_cache": directory, **kw}
        llm = make_llm(**kw)
    before = runner._TRACES[0]
    report = llm.warmup(threads=2)
    return llm, report, runner._TRACES[0] - before


class FailingProgram:
    """Stands in for a loaded executable that fails on the device."""

    def __call__(self, *args):
        raise RuntimeError("INTERNAL: injected failure of a loaded program")


def fail_first_loop_load() -> None:
    load = executable_store.ExecutableStore.load
    failed = []

    def patched(self, key, in_tree):
        compiled = load(self, key, in_tree)
        if compiled is not None and not failed and "LoopBatch" in str(in_tree):
            failed.append(key)
            return FailingProgram()
        return compiled

    executable_store.ExecutableStore.load = patched


def main(directory: str, mode: str) -> dict:
    if mode == "badrun":
        fail_first_loop_load()
    llm, report, traces = warm(directory, mesh=mode == "mesh")
    out = dict(loaded=report.num_loaded, traces=traces, summary=report.summary(),
               programs=[p.name for p in report.programs if p.loaded])  # fmt: skip
    if mode in ("run", "badrun", "mesh"):
        before = llm.stats()["recompiles"]
        out["tokens"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        out["recompiles_after_warmup"] = llm.stats()["recompiles"] - before
        # An engine rebuilt over the same model (a notebook cell run again, a benchmark's fresh
        # engine per run), not warmed up: it runs what the first one's warm-up installed.
        if mode != "mesh":
            rebuilt = make_llm(num_decode_steps=2, max_num_seqs=6, compilation_cache=directory)
            before = runner._TRACES[0]
            out["rebuilt_tokens"] = [o.outputs[0].token_ids
                                     for o in rebuilt.generate(PROMPTS, GREEDY)]  # fmt: skip
            out["rebuilt_traces"] = runner._TRACES[0] - before
            # Under another matmul precision it traces its own programs, as jax.jit would.
            with jax.default_matmul_precision("highest"):
                before = runner._TRACES[0]
                rebuilt.generate(PROMPTS, GREEDY)
                out["rebuilt_highest_traces"] = runner._TRACES[0] - before
        return out
    # Each variant warms up the engine without decode loops: its two step programs (the
    # decode step and the ragged step) have the stored programs' shapes, so only the varied
    # part of the key keeps them from loading ("steps_again": both load without it).
    steps = dict(chain_decode=False, num_decode_steps=1)
    real = executable_store._packages_fingerprint
    executable_store._packages_fingerprint = lambda: "edited"
    out["edited_source"] = warm(directory, **steps)[1].num_loaded
    executable_store._packages_fingerprint = real
    with jax.default_matmul_precision("highest"):
        out["other_jax_flag"] = warm(directory, **steps)[1].num_loaded
    options = {"xla_cpu_enable_fast_math": False}
    out["other_options"] = warm(directory, compiler_options=options, **steps)[1].num_loaded
    out["steps_again"] = warm(directory, **steps)[1].num_loaded
    out["again"] = warm(directory)[1].num_loaded
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
