"""SamplingParams / BeamSearchParams: every field checked when built, with a message that
names the field and the value expected; int-like fields take int / np.integer only."""

import numpy as np
import pytest

import jpaged

BAD_SAMPLING = [
    ({"max_tokens": True}, "max_tokens=True must be an int >= 1"),
    ({"max_tokens": 2.0}, "max_tokens=2.0 must be an int"),
    ({"max_tokens": "4"}, "max_tokens='4' must be an int"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"n": True}, "n=True must be an int >= 1"),
    ({"n": 2.0}, "n=2.0"),
    ({"top_k": False}, "top_k=False must be an int"),
    ({"top_k": 5.0}, "top_k=5.0"),
    ({"seed": True}, "seed=True must be None or an int"),
    ({"seed": 1.5}, "seed=1.5"),
    ({"seed": 2**31}, "seed=2147483648"),
    ({"min_tokens": True}, "min_tokens=True must be an int in"),
    ({"min_tokens": 1.0}, "min_tokens=1.0"),
    ({"temperature": True}, "temperature=True must be a finite float"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": True}, "top_p=True must be in"),
    ({"min_p": 1.5}, r"min_p=1.5 must be a finite float in \[0.0, 1.0\]"),
    ({"min_p": -0.1}, "min_p=-0.1"),
    ({"min_p": "0.1"}, "min_p='0.1'"),
    ({"stop_token_ids": "12"}, "stop_token_ids='12' must be a list of int token ids"),
    ({"stop_token_ids": [2**40]}, r"stop_token_ids=\[1099511627776\] must be a list of int"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids=\[-1\]"),
    ({"stop_token_ids": [True]}, r"stop_token_ids=\[True\]"),
    ({"stop_token_ids": [1.0]}, r"stop_token_ids=\[1.0\]"),
    ({"stop_token_ids": 7}, "stop_token_ids=7"),
    ({"stop_token_ids": b"12"}, "stop_token_ids=b'12'"),
    ({"ignore_eos": 1}, "ignore_eos=1 must be a bool"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes'"),
    ({"stop": ""}, "stop='' must be a non-empty string or a list"),
    ({"stop": ["a", 3]}, r"stop=\['a', 3\]"),
    ({"stop": 5}, "stop=5"),
    ({"logprobs": 21}, r"logprobs=21 must be None or an int in \[0, 20\]"),
    ({"logprobs": True}, "logprobs=True"),
    ({"logprobs": -1}, "logprobs=-1"),
    ({"prompt_logprobs": 2.0}, r"prompt_logprobs=2.0 must be None or an int in \[0, 20\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be a finite float > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
    ({"repetition_penalty": True}, "repetition_penalty=True"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5 must be a finite float in \[-2.0, 2.0\]"),
    ({"frequency_penalty": -3}, "frequency_penalty=-3"),
    ({"frequency_penalty": None}, "frequency_penalty=None"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias=.* must be a dict of int token ids"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias="),
    ({"logit_bias": {True: 1.0}}, "logit_bias="),
    ({"logit_bias": {2**40: 1.0}}, "logit_bias="),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias="),
    ({"logits_processors": [3]}, r"logits_processors=\[3\] must be a list of functions"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_SAMPLING, ids=[str(k) for k, _ in BAD_SAMPLING])
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jpaged.SamplingParams(**kwargs)


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(ValueError) as e:
        jpaged.SamplingParams(max_tokens=True, n=1.0, stop_token_ids="12", min_p=3)
    msg = str(e.value)
    for name in ("max_tokens=True", "n=1.0", "stop_token_ids='12'", "min_p=3"):
        assert name in msg


def test_good_values_are_normalised():
    p = jpaged.SamplingParams(
        max_tokens=np.int64(4), stop_token_ids=np.array([3, 4]), stop="\n", ignore_eos=np.bool_(1),
        logit_bias={np.int32(7): np.float32(-2.0)}, logits_processors=[abs], logprobs=0,
        prompt_logprobs=np.int8(3), top_k=-1, seed=np.uint16(9),
    )  # fmt: skip
    assert p.stop_token_ids == (3, 4) and p.stop == ("\n",)
    assert p.logit_bias == {7: -2.0} and type(next(iter(p.logit_bias))) is int
    assert p.logits_processors == (abs,)
    assert jpaged.SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert jpaged.SamplingParams().stop == () and jpaged.SamplingParams().logit_bias is None


BAD_BEAM = [
    ({"beam_width": True}, "beam_width=True must be an int >= 1"),
    ({"beam_width": 2.0}, "beam_width=2.0"),
    ({"max_tokens": True}, "max_tokens=True"),
    ({"length_penalty": True}, "length_penalty=True must be finite"),
    ({"early_stopping": 1}, "early_stopping=1 must be True, False or 'never'"),
    ({"early_stopping": "always"}, "early_stopping='always'"),
    ({"stop_token_ids": "12"}, "stop_token_ids='12'"),
    ({"stop_token_ids": [2**40]}, r"stop_token_ids=\[1099511627776\]"),
    ({"ignore_eos": 0}, "ignore_eos=0 must be a bool"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_BEAM, ids=[str(k) for k, _ in BAD_BEAM])
def test_bad_beam_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jpaged.BeamSearchParams(**kwargs)


def test_beam_params_accept_numpy_ints_and_never():
    p = jpaged.BeamSearchParams(beam_width=np.int32(3), early_stopping="never",
                                stop_token_ids=[np.int64(5)])  # fmt: skip
    assert p.stop_token_ids == (5,) and p.early_stopping == "never"
    assert jpaged.BeamSearchParams(early_stopping=np.bool_(True)).early_stopping is True
