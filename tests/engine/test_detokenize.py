"""Incremental detokenization: streamed text only grows, never rewrites what it emitted, and
the finished text is exactly the full decode."""

import itertools
import pathlib

import numpy as np
import pytest

import jpaged
from jpaged.engine.detokenize import Detokenizer
from jpaged.models import load_tokenizer

CKPT = pathlib.Path(__file__).parents[1] / "checkpoints" / "llama2"


class CountingTokenizer:
    """Wraps a tokenizer, counting the token ids it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


@pytest.mark.parametrize("source", ["text", "random"])
def test_streamed_text_grows_and_ends_equal_to_the_full_decode(source):
    tok = load_tokenizer(CKPT)
    rng = np.random.default_rng(0)
    if source == "text":  # words, digits, punctuation, spaces, non-ASCII (byte fallback)
        ids = tok.encode("Héllo wörld, 12 naïve cafés: the quick brown fox — ok! 日本").ids * 4
    else:
        ids = rng.integers(0, tok.get_vocab_size(), 300).tolist()
    counting = CountingTokenizer(tok)
    d, n, text = Detokenizer(), 0, ""
    while n < len(ids):
        n = min(len(ids), n + int(rng.integers(1, 9)))  # 1-8 tokens per step, as decode loops
        new = d.update(counting, ids[:n])
        assert new.startswith(text)  # never rewrites what was emitted
        text = new
    assert tok.decode(ids).startswith(text)
    assert d.update(counting, ids, finished=True) == tok.decode(ids)
    # Linear, not quadratic: each update decodes a short window (plus the one final decode).
    assert counting.decoded < 6 * len(ids) + len(ids)


def test_engine_streams_incremental_text():
    llm = jpaged.LLM(CKPT, page_size=8, num_pages=64, max_num_seqs=4, max_model_len=64,
                     num_decode_steps=4)  # fmt: skip
    params = jpaged.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    texts = []
    for out in llm.stream(["The quick brown fox"], params):
        texts.append(out.outputs[0].text)
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert out.finished and texts[-1] == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_byte_fallback_runs_that_turn_invalid_never_rewrite_streamed_text():
    """A SentencePiece-style decoder (byte fallback) renders a whole run of byte tokens as
    U+FFFD once a stray byte makes it invalid: streamed text must still only grow."""
    from tokenizers import Tokenizer, decoders
    from tokenizers import models as tok_models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for w in ("\u2581", "\u2581hello", "hello", "\u2581world", "a"):
        vocab[w] = len(vocab)
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    byte = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    rng = np.random.default_rng(1)
    cases = [[vocab["\u2581hello"], byte[0xC3], byte[0xA9], byte[0xA9], vocab["\u2581world"]]]
    cases += [rng.integers(0, len(vocab), 40).tolist() for _ in range(200)]
    for ids in cases:
        d, text = Detokenizer(), ""
        for n in range(1, len(ids) + 1):
            new = d.update(tok, ids[:n])
            assert new.startswith(text), (ids[:n], text, new)
            # What was streamed is text some prefix of the tokens decodes to (no splice of
            # an old rendering with a new one).
            assert any(tok.decode(ids[:m]).startswith(new) for m in range(n + 1)), (ids, new)
            text = new
        assert d.update(tok, ids, finished=True) == tok.decode(ids)
