"""The jpaged demo: a small trained model answers sums, and the engine shows its work.

The default model ships inside the package (``jpaged.demo_model_path()``): a 1.6M-parameter
Llama trained by ``examples/train_demo_model.py`` to answer "a+b=" with the sum, for
0 <= a, b < 1000. Every answer can be checked, so the output says whether the engine did
the right thing under each feature:

1. greedy answers to a batch of sums it never saw in training;
2. the same batch in a deliberately tiny page pool (sequences are preempted and resumed;
   the answers must not change);
3. parallel sampling (n completions of one prompt share the prompt's pages);
4. a prefix-cache hit (the prompt's pages are reused; the answer must not change);
5. beam search (beams with their scores);
6. ``llm.stats()``, each figure explained.

It ends with ``demo check: <right>/<total> correct`` and exits with status 1 if fewer than
95% are right. Another local checkpoint (Llama, Mistral, Qwen2) runs with ``--model PATH``:
greedy answers to the ``--prompt`` texts, parallel sampling, beam search and the stats,
nothing checked.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax

import jpaged

PASS_FRACTION = 0.95
NUM_SUMS = 16
STATS_MEANING = {
    "pages_total": "pages in the device pool",
    "pages_free": "pages on the free list now",
    "pages_used": "pages held by at least one sequence now",
    "pages_shared": "pages held by more than one sequence now (parallel samples, beams)",
    "pages_cached": "pages registered in the prefix cache (held or evictable)",
    "pages_evictable": "cached pages no sequence holds: reused on a hit, evicted when needed",
    "kv_utilisation": "pages_used / pages_total: the share of the pool held by sequences",
    "kv_page_fill": "live_tokens / (pages_used x page size): how full the held pages are",
    "live_tokens": "distinct token slots holding K/V of a live sequence now",
    "logical_tokens": "the live sequences' lengths summed (shared tokens counted per sequence)",
    "prefix_queries": "prefix-cache lookups (one per admitted prompt)",
    "prefix_hit_tokens": "prompt tokens served from the prefix cache instead of recomputed",
    "prefix_hit_rate": "prefix_hit_tokens / prompt tokens looked up",
    "preemptions_recompute": "sequences evicted for lack of pages and later recomputed",
    "preemptions_swap": "sequences evicted for lack of pages and swapped to host memory",
    "cow_copies": "copy-on-write page copies (a shared page written by one sharer)",
    "swapped_out_bytes": "bytes of K/V copied device -> host by swap preemption",
    "swapped_in_bytes": "bytes of K/V copied host -> device when swapped sequences resumed",
    "recompiles": "XLA programs compiled by the engine so far",
    "steps": "scheduling steps run",
    "device_calls": "calls into compiled step programs",
    "loop_decode_steps": "decode steps run inside decode loops (chains)",
    "tokens_generated": "tokens sampled, over all sequences",
    "time_schedule_s": "host seconds spent scheduling",
    "time_step_s": "seconds spent in steps (host work and device waits)",
    "time_device_wait_s": "seconds of that spent waiting for device results",
    "time_dispatch_s": "seconds the calls that start device work took to return",
    "running": "requests running now",
    "waiting": "requests waiting for admission now",
}


def engine(path, *, num_pages: int, max_num_seqs: int = 16, **kw) -> jpaged.LLM:
    return jpaged.LLM(path, page_size=4, num_pages=num_pages, max_num_seqs=max_num_seqs,
                      max_model_len=32, max_num_batched_tokens=64, **kw)  # fmt: skip


def sums(model: pathlib.Path, count: int) -> list[tuple[int, int]]:
    """``count`` sums the model never saw in training, spread over its held-out list."""
    pairs = json.loads((model / "heldout_pairs.json").read_text())["pairs"]
    return [tuple(p) for p in pairs[:: max(len(pairs) // count, 1)][:count]]


def answers(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def show_sums(pairs, got) -> int:
    """Prints the answers four to a line; returns how many are right."""
    cells = []
    for (a, b), text in zip(pairs, got, strict=True):
        mark = "ok" if text == str(a + b) else f"WRONG, {a + b}"
        cells.append(f"{a:>3}+{b:<3}= {text:<5}({mark})")
    for i in range(0, len(cells), 4):
        print("  " + "   ".join(cells[i : i + 4]))
    return sum(text == str(a + b) for (a, b), text in zip(pairs, got, strict=True))


def watch(llm: jpaged.LLM, prompt: str, params) -> tuple[jpaged.RequestOutput, int]:
    """Runs one request step by step; returns its output and the most pages shared at once."""
    rid = llm.add_request(prompt, params)
    peak = 0
    while llm.has_unfinished_requests():
        llm.step()
        peak = max(peak, llm.stats()["pages_shared"])
    return llm.get_output(rid), peak


def print_stats(llm: jpaged.LLM, note: str = "") -> None:
    print(f"\n== llm.stats(){note}")
    for key, value in llm.stats().items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:22s} {shown:>9}  {STATS_MEANING.get(key, '(see jpaged.LLM.stats)')}")


def demo(model: pathlib.Path) -> int:
    """The checked demo on the addition model; returns the process exit status."""
    greedy = jpaged.SamplingParams(max_tokens=5, temperature=0.0)
    pairs = sums(model, NUM_SUMS)
    prompts = [f"{a}+{b}=" for a, b in pairs]
    right = total = 0

    llm = engine(model, num_pages=128)
    print(f"== greedy: {len(pairs)} sums the model never saw in training, one batch")
    first = answers(llm.generate(prompts, greedy))
    n = show_sums(pairs, first)
    right, total = right + n, total + len(pairs)
    print(f"  {n}/{len(pairs)} right")

    # One synchronous step per call: a decode chain reserves pages ahead, which would keep
    # sequences from outgrowing the pool (and so from being preempted) in so short a run.
    tiny = engine(model, num_pages=12, max_num_seqs=8, chain_decode=False)
    print(f"\n== the same batch in a tiny pool ({tiny.stats()['pages_total']} pages of "
          f"{tiny.page_size} tokens: sequences are admitted, outgrow the pool and are "
          "preempted)")  # fmt: skip
    again = answers(tiny.generate(prompts, greedy))
    s = tiny.stats()
    n = sum(x == y == str(a + b) for x, y, (a, b) in zip(first, again, pairs, strict=True))
    right, total = right + n, total + len(pairs)
    print(f"  preemptions: {s['preemptions_recompute']} by recompute, {s['preemptions_swap']} "
          f"by swap; answers unchanged: {again == first} ({n}/{len(pairs)} right)")  # fmt: skip

    # A prompt of two 3-digit numbers: 9 tokens with <bos>, two full pages and one more.
    i = next(i for i, (a, b) in enumerate(pairs) if a >= 100 and b >= 100)
    (a, b), prompt = pairs[i], prompts[i]
    print(f"\n== parallel sampling: n=4 completions of {prompt!r} at temperature 1.0")
    out, peak = watch(llm, prompt, jpaged.SamplingParams(max_tokens=5, temperature=1.0, n=4,
                                                         seed=0))  # fmt: skip
    texts = [c.text for c in out.outputs]
    print(f"  {texts}: the 4 sequences shared up to {peak} page(s) of the prompt (copy on write)")

    print(f"\n== prefix cache: {prompt!r} again")
    cached = llm.generate(prompt, greedy)[0]
    ok = cached.outputs[0].text == first[i] == str(a + b)
    right, total = right + ok, total + 1
    print(f"  {cached.outputs[0].text!r}, unchanged: {ok}; {cached.num_cached_tokens} of "
          f"{len(cached.prompt_token_ids)} prompt tokens came from cached pages "
          f"({cached.num_cached_tokens // llm.page_size} page(s) reused)")  # fmt: skip

    print(f"\n== beam search: width 3 on {prompts[1]!r}")
    beams = llm.beam_search(prompts[1], jpaged.BeamSearchParams(beam_width=3, max_tokens=5))
    for c in beams[0].outputs:
        print(f"  beam {c.index}: {c.text!r:8} score {c.score:.4f}")
    ok = beams[0].outputs[0].text == str(sum(pairs[1]))
    right, total = right + ok, total + 1

    print_stats(llm, " of the main engine (the tiny pool's engine counted the preemptions)")
    print(f"\ndemo check: {right}/{total} correct")
    return 0 if right >= PASS_FRACTION * total else 1


def free_text(model: pathlib.Path, prompts: list[str]) -> int:
    """Another checkpoint: greedy, parallel sampling, beam search and stats, unchecked."""
    llm = engine(model, num_pages=128)
    greedy = jpaged.SamplingParams(max_tokens=16, temperature=0.0)
    print("== greedy")
    for o in llm.generate(prompts, greedy):
        print(f"  {o.prompt!r} -> {o.outputs[0].text!r}")
    out, peak = watch(llm, prompts[0], jpaged.SamplingParams(max_tokens=16, n=3, seed=0))
    print(f"\n== parallel sampling, n=3 (up to {peak} page(s) shared)")
    for c in out.outputs:
        print(f"  [{c.index}] {c.text!r}")
    print("\n== beam search, width 3")
    beams = llm.beam_search(prompts[0], jpaged.BeamSearchParams(beam_width=3, max_tokens=8))
    for c in beams[0].outputs:
        print(f"  {c.text!r} score {c.score:.4f}")
    print_stats(llm)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=pathlib.Path, default=jpaged.demo_model_path(),
                        help="checkpoint directory (default: the shipped addition model)")  # fmt: skip
    parser.add_argument("--prompt", action="append",
                        help="prompt for a --model without heldout_pairs.json (repeatable)")  # fmt: skip
    args = parser.parse_args()
    t0 = time.perf_counter()
    print(f"jpaged demo on {args.model.name} (jax {jax.__version__}, {jax.default_backend()})\n")
    if (args.model / "heldout_pairs.json").is_file():
        status = demo(args.model)
    else:
        status = free_text(args.model, args.prompt or ["The quick brown fox", "Paged attention"])
    print(f"wall time {time.perf_counter() - t0:.1f} s (compiles included)")
    sys.exit(status)


if __name__ == "__main__":
    main()
