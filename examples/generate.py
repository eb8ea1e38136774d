"""Generate text with jpaged.LLM on a tiny model that ships with the repository.

The default model is the tiny random-weight Llama checkpoint in ``tests/checkpoints/llama2``
(a real Hugging Face checkpoint directory with a tokenizer, a few hundred KB), so the text is
gibberish: the point is the engine. Any local Llama / Mistral / Qwen2 checkpoint works:

    .venv/bin/python examples/generate.py --model /path/to/checkpoint

With ``--model random`` it builds a tiny Llama from a fixed seed instead (no tokenizer,
token ids are printed).

It runs greedy decoding and seeded sampling over a batch of prompts, parallel sampling
(n=3, the prompt's pages shared), a repeated prompt (a prefix-cache hit) and beam search,
then prints ``llm.stats()``.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax

import jpaged

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "tests" / "checkpoints" / "llama2"

PROMPTS = [
    "The quick brown fox jumps",
    "Paged attention stores the KV cache in fixed-size pages",
    "Copy on write lets beams share pages",
    "JAX compiles the whole decode step",
]


def build(model_arg: str, args) -> jpaged.LLM:
    kw = dict(
        page_size=args.page_size, num_pages=args.num_pages, max_num_seqs=16,
        max_model_len=128, max_num_batched_tokens=64,
    )  # fmt: skip
    if model_arg == "random":
        from flax import nnx

        model = jpaged.models.LlamaForCausalLM(
            jpaged.models.tiny(max_position_embeddings=128), rngs=nnx.Rngs(0)
        )
        return jpaged.LLM(model, **kw)
    return jpaged.LLM(model_arg, **kw)


def show(title: str, outputs) -> None:
    print(f"\n== {title}")
    for out in outputs:
        prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
        print(f"prompt: {prompt!r}  (cached prompt tokens: {out.num_cached_tokens})")
        for c in out.outputs:
            body = c.text if c.text is not None else c.token_ids
            extra = f" score={c.score:.4f}" if c.score is not None else ""
            print(f"  [{c.index}] {body!r}  ({c.finish_reason}{extra})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint dir or 'random'")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--num-pages", type=int, default=128)
    args = parser.parse_args()

    llm = build(args.model, args)
    print(f"jax {jax.__version__} on {jax.default_backend()}; pool: {llm.alloc.num_pages} pages "
          f"of {llm.page_size} tokens ({llm.cache.bytes / 2**20:.2f} MiB)")  # fmt: skip
    prompts = PROMPTS if llm.tokenizer is not None else [[5, 6, 7, 8, 9], [10, 11, 12], [13]]

    t0 = time.perf_counter()
    greedy = jpaged.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    show("greedy", llm.generate(prompts, greedy, progress=True))
    sampled = jpaged.SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95,
                                    seed=0)  # fmt: skip
    show("sampling (temperature 0.8, top-p 0.95, seed 0)", llm.generate(prompts, sampled))
    parallel = jpaged.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, n=3, seed=1)
    rid = llm.add_request(prompts[0], parallel)  # the low-level API, to watch the pool
    peak_shared = 0
    while llm.has_unfinished_requests():
        llm.step()
        peak_shared = max(peak_shared, llm.stats()["pages_shared"])
    show(f"parallel sampling, n=3 (up to {peak_shared} prompt pages shared by the 3)",
         [llm.get_output(rid)])  # fmt: skip
    show("the same prompt again (prefix-cache hit)", llm.generate(prompts[:1], greedy))
    beams = jpaged.BeamSearchParams(beam_width=3, max_tokens=args.max_tokens // 2)
    show("beam search, width 3", llm.beam_search(prompts[:2], beams))
    print(f"\nwall time (compiles included): {time.perf_counter() - t0:.1f} s")

    print("\n== llm.stats()")
    for k, v in llm.stats().items():
        print(f"  {k:24s} {v:.3f}" if isinstance(v, float) else f"  {k:24s} {v}")


if __name__ == "__main__":
    main()
