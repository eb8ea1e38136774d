"""Trains the demo model: a small Llama that adds integers, written "a+b=" -> "c".

The model is the project's own ``jpaged.models.LlamaForCausalLM`` (Flax NNX), trained with
optax on every sum 0 <= a, b < 1000 except a fixed held-out set, and saved as a Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``generation_config.json``) that ``jpaged.LLM(path)`` and ``transformers`` both load. The
held-out pairs are saved beside it (``heldout_pairs.json``) so that anyone can check the
model on sums it never saw.

Tokens: one per character (``0``-``9``, ``+``, ``=``) plus ``<pad>``, ``<bos>`` and
``<eos>``; the tokenizer adds ``<bos>`` and its decoder joins digits without spaces, so the
answer to ``"123+456="`` decodes to ``"579"``. Numbers are written without leading zeros.

Needs optax (``pip install -e ".[train]"``; the test extra has it too).

Usage (the full run wants a GPU: 30000 steps of 512 sums took 108 s on one H200 and reached
2000/2000 held-out sums; the result ships in ``jpaged/assets/demo_addition``)::

    python examples/train_demo_model.py --out jpaged/assets/demo_addition
    python examples/train_demo_model.py --smoke --out /tmp/demo   # a few CPU steps (CI)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

import jpaged

MAX_N = 1000  # operands 0 .. 999
PAD, BOS, EOS = 0, 1, 2
VOCAB = {"<pad>": PAD, "<bos>": BOS, "<eos>": EOS}
VOCAB |= {str(d): 3 + d for d in range(10)} | {"+": 13, "=": 14}
VOCAB_SIZE = 16  # 15 tokens, rounded up
SEQ = 16  # <bos> 3 digits + 3 digits = 4 digits <eos>: 14 tokens, padded
MAX_ANSWER = 5  # 4 digits and <eos>

# The shipped model: about 1.6M parameters (6.3 MB in f32). GQA 6/2 so that the engine's
# grouped attention paths run on it.
FULL = dict(hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6,
            num_kv_heads=2, head_dim=32)  # fmt: skip
# The smoke run's model: the same code path, small enough for a few CPU steps.
SMOKE = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
             num_kv_heads=1, head_dim=16)  # fmt: skip


def build_tokenizer() -> Tokenizer:
    """A character-level WordLevel tokenizer that adds <bos> and decodes "5","7","9" to "579"."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    return tok


def heldout_pairs(num: int, seed: int) -> np.ndarray:
    """i32[num, 2]: the (a, b) pairs never trained on, drawn without replacement."""
    idx = np.sort(np.random.default_rng(seed).choice(MAX_N * MAX_N, num, replace=False))
    return np.stack([idx // MAX_N, idx % MAX_N], axis=1).astype(np.int32)


def encode_all() -> tuple[np.ndarray, np.ndarray]:
    """Every pair's training sequence and loss mask, row ``a * 1000 + b``.

    Returns:
      ``(tokens, mask)``: u8[M, S] ``<bos>a+b=c<eos>`` padded with ``<pad>``; bool[M, S]
      True where position s predicts an answer token (the answer digits and ``<eos>``).
    """
    a, b = np.divmod(np.arange(MAX_N * MAX_N), MAX_N)
    text = "".join(f"{x}+{y}={x + y}".ljust(SEQ - 2) for x, y in zip(a, b, strict=True))
    chars = np.frombuffer(text.encode(), np.uint8).reshape(-1, SEQ - 2)
    table = np.full(256, PAD, np.uint8)
    for ch, i in VOCAB.items():
        if len(ch) == 1:
            table[ord(ch)] = i
    tokens = np.full((MAX_N * MAX_N, SEQ), PAD, np.uint8)
    tokens[:, 0] = BOS
    tokens[:, 1:-1] = table[chars]
    length = (tokens != PAD).sum(1)  # <bos> + "a+b=c"
    rows = np.arange(len(tokens))
    tokens[rows, length] = EOS
    eq = np.argmax(tokens == VOCAB["="], axis=1)
    pos = np.arange(SEQ)[None, :]
    mask = (pos >= eq[:, None]) & (pos < length[:, None])  # predicts tokens eq+1 .. EOS
    return tokens, mask


def model_config(sizes: dict) -> jpaged.models.ModelConfig:
    return jpaged.models.ModelConfig(
        model_type="llama", vocab_size=VOCAB_SIZE, max_position_embeddings=32,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **sizes,
    )  # fmt: skip


def make_train_chunk(graphdef, tx, tokens_MS, mask_MS, train_idx, *, batch: int, steps: int):
    """A jitted function that runs ``steps`` optimizer steps on freshly drawn batches."""

    def loss_fn(params, tok_BS, mask_BS):
        logits_BSV = nnx.merge(graphdef, params).forward_dense(tok_BS)
        targets_BS = jnp.roll(tok_BS, -1, axis=1)
        nll_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS)
        return jnp.sum(nll_BS * mask_BS) / jnp.sum(mask_BS)

    def one_step(_, carry):
        params, opt_state, key, _ = carry
        key, sub = jax.random.split(key)
        rows = train_idx[jax.random.randint(sub, (batch,), 0, train_idx.shape[0])]
        tok_BS = tokens_MS[rows].astype(jnp.int32)
        loss, grads = jax.value_and_grad(loss_fn)(params, tok_BS, mask_MS[rows])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, loss

    @jax.jit
    def chunk(params, opt_state, key):
        init = (params, opt_state, key, jnp.zeros((), jnp.float32))
        return jax.lax.fori_loop(0, steps, one_step, init)

    return chunk


@functools.partial(jax.jit, static_argnames="graphdef")
def greedy_answers(graphdef, params, prompts_BS: jax.Array, lens_B: jax.Array) -> jax.Array:
    """i32[B, 5]: greedy answer tokens after each prompt (dense forward, no cache).

    ``prompts_BS``: <bos>a+b= padded to S; ``lens_B``: each prompt's length.
    """
    model = nnx.merge(graphdef, params)
    rows = jnp.arange(prompts_BS.shape[0])

    def step(i, buf_BS):
        logits_BSV = model.forward_dense(buf_BS)
        nxt_B = jnp.argmax(logits_BSV[rows, lens_B + i - 1], axis=-1).astype(jnp.int32)
        return buf_BS.at[rows, lens_B + i].set(nxt_B)

    buf_BS = jax.lax.fori_loop(0, MAX_ANSWER, step, prompts_BS)
    return buf_BS[rows[:, None], lens_B[:, None] + jnp.arange(MAX_ANSWER)]


def answers_text(answer_ids: np.ndarray) -> list[str]:
    inv = {i: ch for ch, i in VOCAB.items()}
    out = []
    for row in answer_ids.tolist():
        text = ""
        for t in row:
            if t == EOS:
                break
            text += inv.get(t, "?")
        out.append(text)
    return out


def accuracy(graphdef, params, pairs: np.ndarray, tok: Tokenizer) -> float:
    """Exact greedy answers on ``pairs`` (i32[M, 2]), answers ending in <eos>."""
    enc = [tok.encode(f"{a}+{b}=").ids for a, b in pairs.tolist()]
    lens = np.array([len(e) for e in enc], np.int32)
    prompts = np.full((len(enc), SEQ), PAD, np.int32)
    for i, e in enumerate(enc):
        prompts[i, : len(e)] = e
    right = 0
    for s in range(0, len(enc), 1024):
        ids = np.asarray(greedy_answers(graphdef, params, prompts[s : s + 1024],
                                        lens[s : s + 1024]))  # fmt: skip
        for (a, b), row, text in zip(pairs[s : s + 1024], ids, answers_text(ids), strict=True):
            right += text == str(a + b) and EOS in row.tolist()
    return right / len(pairs)


def hf_tensors(model: jpaged.models.LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's parameters under Hugging Face Llama names and layouts (torch [out, in])."""
    c = model.config
    D = c.hidden_size
    layers = {k: np.asarray(v, np.float32) for k, v in model.layers.unfused().items()}
    per_layer = {
        "input_layernorm.weight": layers["attn_norm_LD"],
        "post_attention_layernorm.weight": layers["mlp_norm_LD"],
        "self_attn.q_proj.weight": layers["wq_LDNH"].reshape(c.num_layers, D, -1).swapaxes(1, 2),
        "self_attn.k_proj.weight": layers["wk_LDKH"].reshape(c.num_layers, D, -1).swapaxes(1, 2),
        "self_attn.v_proj.weight": layers["wv_LDKH"].reshape(c.num_layers, D, -1).swapaxes(1, 2),
        "self_attn.o_proj.weight": layers["wo_LNHD"].reshape(c.num_layers, -1, D).swapaxes(1, 2),
        "mlp.gate_proj.weight": layers["w_gate_LDF"].swapaxes(1, 2),
        "mlp.up_proj.weight": layers["w_up_LDF"].swapaxes(1, 2),
        "mlp.down_proj.weight": layers["w_down_LFD"].swapaxes(1, 2),
    }
    out = {
        "model.embed_tokens.weight": np.asarray(model.embed_VD[...], np.float32),
        "model.norm.weight": np.asarray(model.norm_D[...], np.float32),
        "lm_head.weight": np.asarray(model.lm_head_DV[...], np.float32).T,
    }
    for i in range(c.num_layers):
        for name, w in per_layer.items():
            out[f"model.layers.{i}.{name}"] = w[i]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_checkpoint(out: pathlib.Path, model, tok: Tokenizer, heldout: np.ndarray,
                    info: dict) -> None:  # fmt: skip
    """Writes a Hugging Face Llama checkpoint directory (f32) with its tokenizer."""
    c = model.config
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_theta": c.rope_theta, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS,
        "pad_token_id": PAD, "dtype": "float32",
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(hf_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": c.max_position_embeddings,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    held = {"pairs": heldout.tolist(), **info}
    (out / "heldout_pairs.json").write_text(json.dumps(held, separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=30000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=2000, help="pairs never trained on")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop training early (and still save) after this long")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model, 20 steps, 64 held-out pairs (CI on CPU)")  # fmt: skip
    args = parser.parse_args()
    sizes = FULL
    if args.smoke:
        sizes, args.batch, args.heldout = SMOKE, 32, 64
        args.steps = min(args.steps, 20)
    chunk_steps = min(args.steps, 500)
    num_chunks = math.ceil(args.steps / chunk_steps)
    total = num_chunks * chunk_steps

    t0 = time.perf_counter()
    tok = build_tokenizer()
    heldout = heldout_pairs(args.heldout, seed=1234)
    tokens, mask = encode_all()
    train_idx = np.setdiff1d(np.arange(MAX_N * MAX_N), heldout[:, 0] * MAX_N + heldout[:, 1])
    model = jpaged.models.LlamaForCausalLM(model_config(sizes), rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(1000, total // 10 + 1),
                                                  total, end_value=args.lr * 0.02)  # fmt: skip
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.98, weight_decay=0.01))  # fmt: skip
    opt_state = tx.init(params)
    chunk = make_train_chunk(graphdef, tx, jnp.asarray(tokens), jnp.asarray(mask),
                             jnp.asarray(train_idx, jnp.int32), batch=args.batch,
                             steps=chunk_steps)  # fmt: skip
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"jax {jax.__version__} on {jax.default_backend()}: {n_params / 1e6:.2f}M parameters, "
          f"{len(train_idx)} training pairs, {len(heldout)} held out; {total} steps of "
          f"{args.batch} (setup {time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    key = jax.random.key(args.seed)
    probe = heldout[:256]
    for i in range(num_chunks):
        params, opt_state, key, loss = chunk(params, opt_state, key)
        if (i + 1) % 8 == 0 or i == num_chunks - 1:
            acc = accuracy(graphdef, params, probe, tok)
            print(f"step {(i + 1) * chunk_steps:6d}  loss {float(loss):.4f}  held-out probe "
                  f"{acc:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
            total = (i + 1) * chunk_steps
            print(f"stopping early after {total} steps (--max-seconds {args.max_seconds})")
            break
    acc = accuracy(graphdef, params, heldout, tok)
    print(f"held-out accuracy: {acc:.4f} ({round(acc * len(heldout))}/{len(heldout)}) "
          f"after {total} steps, {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    model = nnx.merge(graphdef, params)
    info = {"heldout_accuracy": acc, "steps": total, "batch": args.batch, "seed": args.seed,
            "heldout_seed": 1234}  # fmt: skip
    save_checkpoint(args.out, model, tok, heldout, info)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
