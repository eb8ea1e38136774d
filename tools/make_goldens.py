"""Builds tiny random Hugging Face checkpoints and golden outputs from `transformers`.

Runs in its own Python 3.11 venv with torch + transformers (`make goldens` creates it); the
library and its tests never import torch. For each model below it writes

- `tests/checkpoints/<name>/`: a real checkpoint directory from `save_pretrained` (f32
  safetensors, sharded for one model), plus `tokenizer.json` for one model;
- `tests/goldens/<name>.json`: prefill logits for a prompt, the logits of each of 32 greedy
  decode steps (`generate(output_logits=True)`, EOS ignored), the 32 greedy tokens, and a
  beam-search result (`generate(num_beams=4, num_return_sequences=4)`).

`--only sampling` writes `tests/goldens/llama2_sampling.json` from the checkpoint already in
`tests/checkpoints/llama2` (nothing is rebuilt): a greedy `generate(repetition_penalty=1.3,
output_scores=True, output_logits=True)` (tokens, the processed scores, the raw logits), and
transformers' `MinPLogitsWarper` applied to fixed random logits (the tokens it keeps), and
`PreTrainedTokenizerFast.apply_chat_template` of a small chat template (text and ids).

It also writes `tests/goldens/demo_addition.json`: the greedy answers of the shipped demo
model (`jpaged/assets/demo_addition`, trained by `examples/train_demo_model.py`) to the first
64 of its held-out sums, from `LlamaForCausalLM.from_pretrained` (`--only demo` writes just
this one; `--demo-checkpoint` reads another copy of the checkpoint).

Weights are random (fixed seed), with larger-than-default init and random biases and norm
weights so that every parameter matters and greedy choices are not near-ties (the script
checks the top-2 logit margin of every greedy step).

Usage: .venv-torch/bin/python tools/make_goldens.py [--out-root .] [--only random|demo|sampling]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 300
NEW_TOKENS = 32
PROMPT_LEN = 19  # not a multiple of the tests' page sizes; longer than Mistral's window
MIN_MARGIN = 1e-3  # top-2 logit gap of every greedy step (keeps argmax robust to f32 noise)
PROMPT_TEXT = "The quick brown fox jumps"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size pages of a shared pool.",
    "A block table maps each sequence's logical blocks to physical pages.",
    "Copy on write lets beams share pages until one of them writes.",
    "JAX compiles the whole decode step, so shapes are bucketed and never change.",
] * 4

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)

MODELS = {
    # Llama 2 style: untied, GQA 4/2, with a tokenizer.json.
    "llama2": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    # Llama 3 style: llama3 RoPE scaling whose original context (16) is shorter than the
    # prompt, so all three frequency bands (kept, blended, divided) occur; tied embeddings.
    "llama3": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=True,
    ),
    # Mistral: sliding window 8 with a 19-token prompt and 32 new tokens; GQA 4/1.
    "mistral": lambda: MistralConfig(
        **COMMON,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v biases, GQA 4/2, sharded checkpoint.
    "qwen2": lambda: Qwen2Config(
        **COMMON,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    ),
}
SHARDED = {"qwen2": "150KB"}
WITH_TOKENIZER = ("llama2",)


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def randomize_extras(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Random biases and norm weights: HF initializes them to 0 and 1, which hides bugs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def floats(x: torch.Tensor) -> list:
    return np.round(x.detach().double().numpy(), 8).tolist()


def make_one(name: str, out_root: pathlib.Path, prompt_ids: list[int]) -> None:
    torch.manual_seed(0)
    config = MODELS[name]()
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    randomize_extras(model, torch.Generator().manual_seed(1))
    model.eval()
    ckpt = out_root / "tests" / "checkpoints" / name
    ckpt.mkdir(parents=True, exist_ok=True)
    for old in ckpt.glob("*"):
        old.unlink()
    model.save_pretrained(ckpt, max_shard_size=SHARDED.get(name, "50GB"))

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        prefill = model(ids).logits[0]  # [S, V]
        model.generation_config.eos_token_id = None  # greedy runs all 32 steps
        greedy = model.generate(
            ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    step_logits = torch.cat(greedy.logits, dim=0)  # [NEW_TOKENS, V]
    tokens = greedy.sequences[0, len(prompt_ids) :].tolist()
    assert tokens == step_logits.argmax(-1).tolist()
    top2 = step_logits.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    if margin < MIN_MARGIN:
        sys.exit(f"{name}: greedy top-2 margin {margin:.2e} < {MIN_MARGIN}: change the seed")

    # Beam search. EOS is a token that a beam of an EOS-free run emits mid-way, so that
    # some hypotheses finish early and the EOS/length-penalty rules are exercised.
    beam_kwargs = dict(
        num_beams=4, num_return_sequences=4, do_sample=False, max_new_tokens=12,
        length_penalty=1.0, early_stopping=True, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        free = model.generate(ids, **beam_kwargs, eos_token_id=None)
        eos = int(free.sequences[1, len(prompt_ids) + 5])
        beams = model.generate(ids, **beam_kwargs, eos_token_id=eos)
    sequences = []
    for row in beams.sequences[:, len(prompt_ids) :].tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        sequences.append(row)

    golden = {
        "model": name,
        "checkpoint": f"tests/checkpoints/{name}",
        "generator": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "script": "tools/make_goldens.py",
        },
        "prompt_text": PROMPT_TEXT if name in WITH_TOKENIZER else None,
        "prompt_ids": prompt_ids,
        "prefill_logits": floats(prefill),
        "greedy": {
            "max_new_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "tokens": tokens,
            "min_top2_margin": margin,
            "step_logits": floats(step_logits),
        },
        "beam_search": {
            "num_beams": 4,
            "num_return_sequences": 4,
            "length_penalty": 1.0,
            "early_stopping": True,
            "max_new_tokens": 12,
            "eos_token_id": eos,
            "prompt_ids": prompt_ids,
            "sequences": sequences,
            "sequence_scores": floats(beams.sequences_scores),
            "notes": (
                "transformers generate(num_beams=4, num_return_sequences=4, do_sample=False, "
                "length_penalty=1.0, early_stopping=True, max_new_tokens=12, eos_token_id=eos), "
                "best first. sequences hold new tokens only (prompt removed), cut after EOS "
                "(padding dropped). sequence_scores = sum of token log-probs / "
                "(new-token count ** length_penalty), as transformers scores them."
            ),
        },
    }
    gold = out_root / "tests" / "goldens" / f"{name}.json"
    gold.parent.mkdir(parents=True, exist_ok=True)
    gold.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    size = sum(f.stat().st_size for f in ckpt.iterdir()) // 1024
    print(f"{name}: checkpoint {size} KB, greedy margin {margin:.2e}, eos {eos}, "
          f"beam lengths {[len(s) for s in sequences]}")  # fmt: skip


DEMO_CHECKPOINT = pathlib.Path("jpaged/assets/demo_addition")
DEMO_SUMS = 64  # the first held-out sums of the demo model
DEMO_NEW_TOKENS = 5  # a 4-digit answer and <eos>


def make_demo_golden(ckpt: pathlib.Path, out_root: pathlib.Path) -> None:
    """Greedy answers of the trained demo model from transformers, for the first held-out sums."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    pairs = json.loads((ckpt / "heldout_pairs.json").read_text())["pairs"][:DEMO_SUMS]
    eos = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    prompts, answers, token_ids = [], [], []
    for a, b in pairs:
        ids = tok.encode(f"{a}+{b}=").ids
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=DEMO_NEW_TOKENS, do_sample=False,
                eos_token_id=eos, pad_token_id=0,
            )  # fmt: skip
        new = seq[0, len(ids) :].tolist()
        prompts.append(f"{a}+{b}=")
        token_ids.append(new)
        answers.append(tok.decode(new))
    right = sum(ans == str(a + b) for ans, (a, b) in zip(answers, pairs, strict=True))
    golden = {
        "model": "demo_addition",
        "checkpoint": str(DEMO_CHECKPOINT),
        "generator": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "script": "tools/make_goldens.py",
        },
        "greedy": {"max_new_tokens": DEMO_NEW_TOKENS, "eos_token_id": eos},
        "prompts": prompts,
        "token_ids": token_ids,
        "answers": answers,
        "num_right": right,
    }
    gold = out_root / "tests" / "goldens" / "demo_addition.json"
    gold.parent.mkdir(parents=True, exist_ok=True)
    gold.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"demo_addition: {right}/{len(pairs)} held-out sums right under transformers")


# A small chat template that exercises what transformers' renderer sets up: trim_blocks and
# lstrip_blocks, special tokens from the tokenizer, a filter, raise_exception, loop controls.
CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<<SYS>>{{ message['content'] | trim }}<</SYS>>
    {% elif message['role'] in ['user', 'assistant'] %}
[{{ message['role'] | upper }}] {{ message['content'] | trim }}
        {%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

    {% else %}
{{ raise_exception('unknown role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}[ASSISTANT] {% endif %}"""
CHAT_MESSAGES = [
    {"role": "system", "content": " Answer briefly. "},
    {"role": "user", "content": "The quick brown fox"},
    {"role": "assistant", "content": "jumps over"},
    {"role": "user", "content": "the lazy dog?"},
]

SAMPLING_NEW_TOKENS = 16
REPETITION_PENALTY = 1.3


def make_sampling_golden(out_root: pathlib.Path) -> None:
    """Repetition-penalty greedy decoding with its scores and raw logits, and min-p masks,
    from transformers, on the llama2 test checkpoint as it is."""
    ckpt = out_root / "tests" / "checkpoints" / "llama2"
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    # A prompt that repeats tokens, so the penalty hits prompt tokens more than once.
    prompt_ids = tok.encode(PROMPT_TEXT).ids + tok.encode(" the the fox").ids
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=SAMPLING_NEW_TOKENS,
            min_new_tokens=SAMPLING_NEW_TOKENS, do_sample=False,
            repetition_penalty=REPETITION_PENALTY, output_scores=True, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    scores = torch.cat(out.scores, dim=0)  # [N, V] after the repetition penalty
    logits = torch.cat(out.logits, dim=0)  # [N, V] raw
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    assert tokens == scores.argmax(-1).tolist()
    top2 = scores.topk(2, dim=-1).values
    margin = float((top2[:, 0] - top2[:, 1]).min())
    if margin < MIN_MARGIN:
        sys.exit(f"sampling golden: greedy top-2 margin {margin:.2e} < {MIN_MARGIN}")
    gen = torch.Generator().manual_seed(3)
    min_p_logits = 2.0 * torch.randn((6, VOCAB), generator=gen)
    min_p, temperature = 0.1, 0.7
    warped = transformers.MinPLogitsWarper(min_p)(
        torch.zeros((6, 1), dtype=torch.long), min_p_logits / temperature
    )
    golden = {
        "model": "llama2",
        "checkpoint": "tests/checkpoints/llama2",
        "generator": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "script": "tools/make_goldens.py --only sampling",
        },
        "repetition": {
            "prompt_ids": prompt_ids,
            "repetition_penalty": REPETITION_PENALTY,
            "max_new_tokens": SAMPLING_NEW_TOKENS,
            "tokens": tokens,
            "min_top2_margin": margin,
            "scores": floats(scores),
            "logits": floats(logits),
            "notes": (
                "generate(do_sample=False, repetition_penalty, output_scores=True, "
                "output_logits=True), EOS ignored: scores are the logits after "
                "RepetitionPenaltyLogitsProcessor (over prompt and generated tokens), logits "
                "the raw ones; the greedy token is the argmax of scores."
            ),
        },
        "min_p": {
            "min_p": min_p,
            "temperature": temperature,
            "logits": floats(min_p_logits),
            "kept": [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in warped],
            "notes": "MinPLogitsWarper(min_p) on logits / temperature: the token ids it keeps.",
        },
    }
    hf_tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    chat = {"template": CHAT_TEMPLATE, "messages": CHAT_MESSAGES}
    for gen_prompt in (True, False):
        text = hf_tok.apply_chat_template(CHAT_MESSAGES, chat_template=CHAT_TEMPLATE,
                                          tokenize=False, add_generation_prompt=gen_prompt)  # fmt: skip
        ids = hf_tok.apply_chat_template(CHAT_MESSAGES, chat_template=CHAT_TEMPLATE,
                                         tokenize=True, add_generation_prompt=gen_prompt)  # fmt: skip
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        key = "with_generation_prompt" if gen_prompt else "without_generation_prompt"
        chat[key] = {"text": text, "token_ids": list(ids)}
    golden["chat"] = chat
    golden["tokenizer"] = {
        "text": PROMPT_TEXT + " over the lazy dog.",
        "encode": hf_tok.encode(PROMPT_TEXT + " over the lazy dog."),
        "decode_ids": [1, *prompt_ids[:6], 2],
        "decode": hf_tok.decode([1, *prompt_ids[:6], 2], skip_special_tokens=True),
    }
    gold = out_root / "tests" / "goldens" / "llama2_sampling.json"
    gold.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    print(f"llama2_sampling: {len(tokens)} tokens, margin {margin:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-root", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--only", choices=("random", "demo", "sampling"), default=None,
                        help="only the random tiny models, only the demo model's golden, or "
                             "only the sampling golden (from the existing llama2 checkpoint)")  # fmt: skip
    parser.add_argument("--demo-checkpoint", type=pathlib.Path, default=DEMO_CHECKPOINT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only == "sampling":
        make_sampling_golden(args.out_root)
        return
    if args.only != "random":
        make_demo_golden(args.demo_checkpoint, args.out_root)
    if args.only == "demo":
        return
    tok = build_tokenizer()
    prompt_ids = tok.encode(PROMPT_TEXT).ids
    if len(prompt_ids) != PROMPT_LEN:
        sys.exit(f"{PROMPT_TEXT!r} encodes to {len(prompt_ids)} tokens, expected {PROMPT_LEN}")
    for name in MODELS:
        make_one(name, args.out_root, prompt_ids)
    for name in WITH_TOKENIZER:
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        hf_tok.save_pretrained(args.out_root / "tests" / "checkpoints" / name)
    make_sampling_golden(args.out_root)


if __name__ == "__main__":
    main()
