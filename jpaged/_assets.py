"""Files shipped inside the package: the trained demo model."""

from __future__ import annotations

import pathlib

_ASSETS = pathlib.Path(__file__).resolve().parent / "assets"


def demo_model_path() -> pathlib.Path:
    """The directory of the demo model: a 1.6M-parameter Llama that adds integers.

    A Hugging Face checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``generation_config.json``) trained by ``examples/train_demo_model.py`` on "a+b=" -> "c"
    for 0 <= a, b < 1000; ``heldout_pairs.json`` beside it lists the sums it never saw.

    >>> import jpaged
    >>> llm = jpaged.LLM(jpaged.demo_model_path(), max_num_seqs=4, num_pages=16)
    >>> llm.generate("123+456=", jpaged.SamplingParams(max_tokens=5, temperature=0.0))[0].outputs[0].text
    '579'
    """
    return _ASSETS / "demo_addition"
