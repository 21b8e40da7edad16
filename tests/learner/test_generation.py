"""Generation with a KV cache on a tiny byte-level Qwen2 (hidden 32, 2 layers): the cached
log-probs and values equal a no-cache recompute on prompt + completion, greedy equals HF's greedy
`generate`, EOS and stop strings end rows with the right lengths, texts and reasons, a swap
stamps later tokens with the new version and samples them from the new weights, and hostile
configs, prompts and versions are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from shoal.envs.tokenizer import ByteTokenizer
from shoal.learner.generation import (
    Completions,
    GenerationError,
    Generator,
    SamplingConfig,
    sampling_log_probs,
)
from shoal.learner.models import CausalLMPolicy, ModelConfig, build_model

TOKENIZER = ByteTokenizer()
VOCAB = 259
PROMPTS = ["def f(x):", "ab", "return x + 1\n", "q"]


def policy(seed: int = 0, favour: str | None = None, eos: bool = True) -> CausalLMPolicy:
    """A tiny byte LM; `favour` gives its LM head a bias towards those bytes (and EOS unless
    `eos` is False), so it writes mostly them (rows then end early, at EOS or a stop string)."""
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=64, max_positions=128)  # fmt: skip
    cfg = ModelConfig(family="causal-lm", arch="qwen2", **sizes)
    obs = spaces.Box(0, VOCAB - 1, shape=(64,), dtype=np.int64)
    model = build_model(cfg, obs, spaces.Discrete(VOCAB))
    assert isinstance(model, CausalLMPolicy)
    if favour is not None:
        old = model.lm.get_output_embeddings()
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        chosen = TOKENIZER.encode(favour) + ([TOKENIZER.eos_id] if eos else [])
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.zero_()
            head.bias[chosen] = 6.0
        model.lm.set_output_embeddings(head)
    return model


def prompts() -> list[list[int]]:
    return [TOKENIZER.encode(p) for p in PROMPTS]


def recompute(model: CausalLMPolicy, prompt: list[int], completion: list[int]):
    """(logits [L, V], values [L]) of each completion token from one no-cache forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        hidden = model.lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        hidden = hidden[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        logits = model.lm.get_output_embeddings()(hidden)[:, : model.action_dim]
        return logits, model.value_head(hidden).squeeze(-1)


def check_against_recompute(model, done: Completions, cfg: SamplingConfig, columns=None) -> None:
    for row, prompt in enumerate(prompts()):
        length = int(done.lengths[row])
        completion = done.tokens[row, :length].tolist()
        logits, values = recompute(model, prompt, completion)
        logp = sampling_log_probs(logits, cfg.temperature, cfg.top_p)
        expected = logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).numpy()
        span = slice(0, length) if columns is None else columns(row, length)
        np.testing.assert_allclose(done.logprobs[row, span], expected[span], atol=2e-4)
        np.testing.assert_allclose(done.values[row, span], values.numpy()[span], atol=2e-4)


def check_padding(done: Completions) -> None:
    for row, length in enumerate(done.lengths):
        assert (done.tokens[row, length:] == TOKENIZER.pad_id).all()
        assert (done.versions[row, length:] == -1).all()
        assert (done.logprobs[row, length:] == 0).all()
        assert (done.values[row, length:] == 0).all()


def test_cached_logprobs_and_values_equal_a_full_recompute():
    model = policy(seed=1)
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=12, stop_at_eos=False)
    done = Generator(model, TOKENIZER, cfg, seed=3).generate(prompts(), version=4)
    assert done.tokens.dtype == np.int64
    assert done.tokens.shape == (4, 12)
    assert done.logprobs.dtype == np.float32
    assert done.values.dtype == np.float32
    assert done.versions.dtype == np.int32
    assert done.lengths.dtype == np.int32
    assert done.lengths.tolist() == [12] * 4
    assert done.stop_reasons == ["length"] * 4
    assert (done.versions == 4).all()
    assert np.isfinite(done.logprobs).all()
    assert (done.logprobs <= 0).all()
    check_against_recompute(model, done, cfg)


def test_rows_that_end_early_leave_the_cache_and_the_rest_stay_exact():
    model = policy(seed=2, favour="ab\n")
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24)
    done = Generator(model, TOKENIZER, cfg, seed=0).generate(prompts() * 3, version=0)
    assert len(set(done.lengths.tolist())) > 1, "rows should end at different steps"
    check_padding(done)
    for row, prompt in enumerate(prompts() * 3):
        length = int(done.lengths[row])
        completion = done.tokens[row, :length].tolist()
        logits, _ = recompute(model, prompt, completion)
        expected = sampling_log_probs(logits, 1.0, 1.0).gather(
            -1, torch.tensor(completion)[:, None]
        )
        np.testing.assert_allclose(done.logprobs[row, :length], expected.squeeze(-1), atol=2e-4)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=0.0, max_new_tokens=16),
        SamplingConfig(temperature=1.0, top_p=1e-6, max_new_tokens=16),
    ],
    ids=["temperature-0", "top-p-tiny"],
)
def test_greedy_equals_hf_greedy_generate(cfg):
    model = policy(seed=5, favour="ab\n")
    done = Generator(model, TOKENIZER, cfg, seed=0).generate(prompts(), version=0)
    width = max(map(len, prompts()))
    ids = torch.tensor([[TOKENIZER.pad_id] * (width - len(p)) + p for p in prompts()])
    mask = torch.arange(width) >= width - torch.tensor([len(p) for p in prompts()])[:, None]
    hf = model.lm.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=TOKENIZER.eos_id,
        pad_token_id=TOKENIZER.pad_id,
        use_cache=True,
    )[:, width:]
    for row in range(len(prompts())):
        length = int(done.lengths[row])
        assert done.tokens[row, :length].tolist() == hf[row, :length].tolist()
        if done.stop_reasons[row] == "eos":
            assert (hf[row, length:] == TOKENIZER.pad_id).all()
        else:
            assert length == 16
    assert (done.logprobs == 0).all(), "a point mass: greedy log-probs are 0"


@pytest.mark.parametrize(
    ("favour", "eos", "stop", "seen"),
    [("ab\n", True, ("ba", "\n\n"), {"eos", "stop"}), ("é\n", False, ("\né",), {"stop"})],
    ids=["ascii", "multi-byte"],
)
def test_eos_and_stop_strings_end_rows_with_the_right_lengths_and_texts(favour, eos, stop, seen):
    model = policy(seed=7, favour=favour, eos=eos)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=20, stop=stop)
    done = Generator(model, TOKENIZER, cfg, seed=1).generate(prompts() * 4, version=2)
    reasons = done.stop_reasons
    assert set(reasons) <= {"eos", "stop", "length"}
    assert seen <= set(reasons)
    check_padding(done)
    for row, reason in enumerate(reasons):
        length = int(done.lengths[row])
        completion = done.tokens[row, :length].tolist()
        assert TOKENIZER.eos_id not in completion[:-1]
        text = TOKENIZER.decode(completion)
        before = TOKENIZER.decode(completion[:-1])
        assert not any(s in before for s in cfg.stop), "a row ends at its first stop"
        if reason == "eos":
            assert completion[-1] == TOKENIZER.eos_id
            assert done.texts[row] == text
        elif reason == "stop":
            first = min(i for s in cfg.stop if (i := text.find(s)) >= 0)
            assert done.texts[row] == text[:first]
        else:
            assert length == 20
            assert done.texts[row] == text
    assert done.tokens.shape[1] == max(done.lengths)


def test_a_swap_stamps_later_tokens_and_samples_them_from_the_new_weights():
    model = policy(seed=3, favour="ab\n")
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=16)
    generator = Generator(model, TOKENIZER, cfg, seed=2)
    state = generator.start(prompts() * 2, version=3)
    for _ in range(5):
        assert generator.step(state)
    before = state.lengths.clone()
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    generator.swap(state, 5)
    assert state.swaps == (0 if state.done else 1)
    while generator.step(state):
        pass
    done = generator.result(state)
    for row, cut in enumerate(before.tolist()):
        length = int(done.lengths[row])
        assert (done.versions[row, :cut] == 3).all()
        assert (done.versions[row, cut:length] == 5).all()
    assert (done.versions == 5).any()
    check_against_recompute(model, done, cfg, columns=lambda row, n: slice(int(before[row]), n))
    model.load_state_dict(old)
    check_against_recompute(model, done, cfg, columns=lambda row, n: slice(0, int(before[row])))


def test_result_waits_for_the_end_and_a_swap_never_goes_back():
    generator = Generator(policy(), TOKENIZER, SamplingConfig(max_new_tokens=3), seed=0)
    state = generator.start(prompts(), version=2)
    with pytest.raises(GenerationError, match="still running"):
        generator.result(state)
    with pytest.raises(GenerationError, match="older than"):
        generator.swap(state, 1)
    while generator.step(state):
        pass
    assert not generator.step(state)
    assert generator.result(state).lengths.tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"top_p": 0.0}, r"top_p = 0.0 is out of range"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens = 0 is out of range"),
        ({"max_new_tokens": 10**6}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"stop": ("",)}, "stop string"),
        ({"stop": ("x" * 65,)}, "stop string"),
        ({"stop": ["a"]}, "stop must be a tuple"),
        ({"stop": (1,)}, "stop string"),
        ({"stop": ("a",) * 17}, "17 stop strings"),
        ({"stop_at_eos": 1}, "stop_at_eos"),
        ({"weight_arrival": "later"}, "weight_arrival"),
    ],
)
def test_hostile_sampling_configs_are_refused(kwargs, message):
    with pytest.raises(GenerationError, match=message):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "prompts must be a list"),
        ("abc", "prompts must be a list"),
        ([[]], "prompt 0 must be a list of 1 to"),
        ([[1], (1, 2)], "prompt 1 must be a list"),
        ([[1] * 200], "shorten it"),
        ([[-1]], "not an integer in"),
        ([[VOCAB]], "not an integer in"),
        ([[1.0]], "not an integer in"),
        ([[True]], "not an integer in"),
        ([[1]] * 4097, "prompts must be a list of 1 to 4096"),
    ],
)
def test_hostile_prompts_are_refused(batch, message):
    generator = Generator(policy(), TOKENIZER, SamplingConfig(max_new_tokens=8))
    with pytest.raises(GenerationError, match=message):
        generator.start(batch, version=0)


@pytest.mark.parametrize("version", [-1, True, 2**31, 1.0, "3"])
def test_hostile_versions_are_refused(version):
    generator = Generator(policy(), TOKENIZER, SamplingConfig(max_new_tokens=2))
    with pytest.raises(GenerationError, match="policy version"):
        generator.start(prompts(), version=version)


def test_a_tokenizer_that_does_not_fit_the_model_is_refused():
    class Wide(ByteTokenizer):
        eos_id = 300

    with pytest.raises(GenerationError, match="EOS id 300 can never be sampled"):
        Generator(policy(), Wide(), SamplingConfig())


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=12),
    temperature=st.floats(0.05, 5.0),
    top_p=st.floats(1e-6, 1.0),
)
def test_the_sampling_distribution_is_a_normalised_nucleus(logits, temperature, top_p):
    raw = torch.tensor(logits)
    logp = sampling_log_probs(raw, temperature, top_p)
    probs = logp.exp()
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-5)
    kept = torch.isfinite(logp)
    assert bool(kept[raw.argmax()])
    full = (raw / temperature).softmax(-1)
    assert float(full[kept].sum()) >= top_p - 1e-5
    # the nucleus is the most likely tokens: nothing dropped beats anything kept
    if (~kept).any():
        assert float(full[~kept].max()) <= float(full[kept].min()) + 1e-6
    if top_p == 1.0:
        torch.testing.assert_close(logp, (raw / temperature).log_softmax(-1))


def test_the_learner_recomputes_the_recorded_logprobs_and_values_exactly():
    """learner/token_ppo.py's one-forward recompute at the sampling temperature gives back the
    generator's behaviour log-probs and values: an on-policy ratio is 1."""
    from shoal.learner.token_ppo import token_outputs

    model = policy(seed=4, favour="ab\n")
    cfg = SamplingConfig(temperature=0.8, max_new_tokens=16)
    batch = prompts() * 2
    done = Generator(model, TOKENIZER, cfg, seed=5).generate(batch, version=0)
    rows = [p + done.tokens[i, : done.lengths[i]].tolist() for i, p in enumerate(batch)]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [TOKENIZER.pad_id] * (width - len(r)) for r in rows])
    with torch.no_grad():
        out = token_outputs(
            model,
            tokens,
            torch.tensor([len(p) for p in batch]),
            torch.from_numpy(done.lengths),
            cfg.temperature,
        )
    inside = np.arange(done.tokens.shape[1])[None, :] < done.lengths[:, None]
    np.testing.assert_allclose(out.logprobs.numpy(), done.logprobs[inside], atol=2e-4)
    np.testing.assert_allclose(out.values.numpy(), done.values[inside], atol=2e-4)
