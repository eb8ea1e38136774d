"""The shipped demo model (jpaged/assets/demo_addition) and the script that trains it."""

from __future__ import annotations

import doctest
import json
import pathlib
import subprocess
import sys

import jpaged

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "goldens" / "demo_addition.json"
EOS = 2


def _greedy(llm: jpaged.LLM, prompts: list[str]) -> list[jpaged.RequestOutput]:
    return llm.generate(prompts, jpaged.SamplingParams(max_tokens=5, temperature=0.0))


def _strip_eos(ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] == EOS else ids


def test_demo_model_answers_held_out_sums_as_transformers_does():
    path = jpaged.demo_model_path()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 10 * 2**20
    golden = json.loads(GOLDEN.read_text())
    pairs = json.loads((path / "heldout_pairs.json").read_text())["pairs"]
    spread = pairs[64::61][:32]  # held-out sums beyond the golden's, over the whole range
    prompts = golden["prompts"] + [f"{a}+{b}=" for a, b in spread]
    llm = jpaged.LLM(path, page_size=4, num_pages=256, max_num_seqs=32, max_model_len=32,
                     max_num_batched_tokens=128)  # fmt: skip
    outs = _greedy(llm, prompts)

    n = len(golden["prompts"])
    got_ids = [_strip_eos(o.outputs[0].token_ids) for o in outs[:n]]
    assert got_ids == [_strip_eos(ids) for ids in golden["token_ids"]]
    assert [o.outputs[0].text for o in outs[:n]] == golden["answers"]
    expected = [str(sum(int(x) for x in p[:-1].split("+"))) for p in prompts]
    right = sum(o.outputs[0].text == e for o, e in zip(outs, expected, strict=True))
    assert right >= 0.99 * len(prompts), f"{right}/{len(prompts)} right"
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_demo_model_path_doctest():
    import jpaged._assets

    assert doctest.testmod(jpaged._assets).failed == 0


def test_training_script_smoke_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_demo_model.py"), "--smoke", "--out",
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy:" in proc.stdout
    files = {f.name for f in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tok = jpaged.models.load_tokenizer(out)
    assert tok.encode("12+34=").tokens == ["<bos>", "1", "2", "+", "3", "4", "="]
    assert tok.decode(tok.encode("579").ids) == "579"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS
    llm = jpaged.LLM(out, page_size=4, num_pages=16, max_num_seqs=2, max_model_len=32)
    (completion,) = _greedy(llm, ["12+34="])[0].outputs
    assert 1 <= len(completion.token_ids) <= 5
