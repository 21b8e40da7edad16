"""The causal-lm family on tiny Qwen2 and Llama configs (hidden 32, 2 layers): act/forward/value
on int64 token ids, the value head, spec round trip, weights in bfloat16, export as a
save_pretrained directory that transformers loads back, local directories only (never the Hub),
and hostile LM configs in a spec refused."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from gymnasium import spaces

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from shoal.envs import make_vector
from shoal.learner.errors import PolicyError
from shoal.learner.models import (
    CausalLMPolicy,
    MLPPolicy,
    ModelConfig,
    build_model,
    export_pretrained,
    model_from_spec,
)

TOKENS = spaces.Box(0, 63, shape=(8,), dtype=np.int64)


def tiny(arch: str, **overrides) -> ModelConfig:
    sizes = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=64, max_positions=64)  # fmt: skip
    return ModelConfig(family="causal-lm", arch=arch, **{**sizes, **overrides})


@pytest.fixture(autouse=True)
def offline_one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tokens(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 64, size=(batch, 8), dtype=np.int64)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_causal_lm_acts_and_evaluates_on_token_ids(arch):
    torch.manual_seed(0)
    policy = build_model(tiny(arch), TOKENS, spaces.Discrete(5))
    assert isinstance(policy, CausalLMPolicy)
    assert policy.lm.config.model_type == arch
    assert policy.obs_dtype == np.int64
    assert policy.discrete
    assert policy.action_dim == 5
    assert len(policy.shard_units()) == 4  # the embeddings, 2 decoder layers, the LM head
    obs = tokens(4)
    actions, logp, values = policy.act(obs)
    assert actions.shape == (4,)
    assert actions.dtype == np.int64
    assert (actions < 5).all()
    assert logp.shape == values.shape == (4,)
    assert logp.dtype == values.dtype == np.float32
    np.testing.assert_allclose(policy.value(obs), values, rtol=1e-5, atol=1e-6)
    policy.eval()
    logp2, entropy, values2 = policy(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logp2.detach().numpy(), logp, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(values2.detach().numpy(), values, rtol=1e-4, atol=1e-5)
    assert (entropy <= np.log(5) + 1e-5).all()
    # the policy's logits are the LM's last-position logits, first n of the vocabulary
    full = policy.lm(input_ids=torch.from_numpy(obs)).logits[:, -1, :5]
    expected = torch.log_softmax(full, -1).gather(-1, torch.from_numpy(actions)[:, None])[:, 0]
    torch.testing.assert_close(logp2, expected, rtol=1e-4, atol=1e-5)
    (logp2.sum() + values2.sum()).backward()
    assert policy.value_head.weight.grad is not None
    assert policy.lm.get_input_embeddings().weight.grad is not None


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_spec_round_trip_and_bfloat16_weights(arch):
    torch.manual_seed(1)
    policy = build_model(tiny(arch), TOKENS, spaces.Discrete(5))
    spec = json.loads(json.dumps(policy.spec(), allow_nan=False))
    torch.manual_seed(2)
    clone = model_from_spec(spec)
    assert isinstance(clone, CausalLMPolicy)
    assert clone.spec() == policy.spec()
    clone.set_weights(policy.get_weights())
    obs = tokens(3, seed=1)
    np.testing.assert_array_equal(clone.value(obs), policy.value(obs))
    np.testing.assert_array_equal(clone.act(obs, True)[1], policy.act(obs, True)[1])
    clone.set_weights({k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()})
    assert all(p.dtype == torch.float32 for p in clone.parameters())
    np.testing.assert_allclose(clone.value(obs), policy.value(obs), atol=0.05)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(3)
    plain = build_model(tiny("qwen2"), TOKENS, spaces.Discrete(5))
    checkpointed = model_from_spec(plain.spec())
    checkpointed.set_weights(plain.get_weights())
    checkpointed.enable_activation_checkpointing()
    obs, actions = torch.from_numpy(tokens(4, seed=2)), torch.tensor([0, 1, 2, 3])
    for model in (plain, checkpointed):
        model.train()
        logp, _, values = model(obs, actions)
        (logp.sum() + values.sum()).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name, rtol=1e-4, atol=1e-6)


def test_export_pretrained_loads_in_transformers_and_back_as_a_policy(tmp_path):
    torch.manual_seed(4)
    policy = build_model(tiny("llama"), TOKENS, spaces.Discrete(5))
    out = export_pretrained(policy, tmp_path / "export")
    assert (out / "config.json").is_file()
    assert (out / "value_head.safetensors").is_file()
    assert json.loads((out / "shoal_policy.json").read_text()) == policy.spec()
    lm = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    obs = torch.from_numpy(tokens(2, seed=3))
    with torch.no_grad():
        torch.testing.assert_close(lm(input_ids=obs).logits, policy.lm(input_ids=obs).logits)
    loaded = build_model(ModelConfig(family="causal-lm", path=str(out)), TOKENS, spaces.Discrete(5))
    np.testing.assert_array_equal(loaded.value(obs.numpy()), policy.value(obs.numpy()))
    mlp = MLPPolicy(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2))
    with pytest.raises(PolicyError, match="only causal-lm policies export"):
        export_pretrained(mlp, tmp_path / "nope")


def test_a_missing_directory_says_what_to_do_and_nothing_is_downloaded(tmp_path):
    for path in (tmp_path / "absent", "Qwen/Qwen2-0.5B"):
        with pytest.raises(PolicyError, match=r"not a save_pretrained directory.*never downloads"):
            build_model(ModelConfig(family="causal-lm", path=str(path)), TOKENS, spaces.Discrete(5))


def test_spaces_that_do_not_fit_the_lm_are_refused():
    with pytest.raises(PolicyError, match="token ids must be < 64"):
        build_model(tiny("qwen2"), spaces.Box(0, 100, (8,), np.int64), spaces.Discrete(5))
    with pytest.raises(PolicyError, match="at most 64 long"):
        build_model(tiny("qwen2"), spaces.Box(0, 63, (65,), np.int64), spaces.Discrete(5))
    with pytest.raises(PolicyError, match="n <= the vocabulary"):
        build_model(tiny("qwen2"), TOKENS, spaces.Discrete(65))
    with pytest.raises(PolicyError, match="token-id observations"):
        build_model(tiny("qwen2"), spaces.Box(0, 1, (8,), np.float32), spaces.Discrete(5))
    multi = spaces.MultiDiscrete(np.full(8, 64))
    assert build_model(tiny("qwen2"), multi, spaces.Discrete(5)).act(tokens(2))[0].shape == (2,)


def test_hostile_lm_configs_in_a_spec_are_refused():
    spec = build_model(tiny("qwen2"), TOKENS, spaces.Discrete(5)).spec()
    for change, message in (
        ({"model_type": "bert"}, "model_type 'bert' is not supported"),
        ({"auto_map": {"AutoModel": "evil.Model"}}, "'auto_map' is not accepted"),
        ({"quantization_config": {}}, "'quantization_config' is not accepted"),
        ({"__class__": 1}, "'__class__' is not accepted"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is invalid"),
        ({"vocab_size": True}, "vocab_size = True is invalid"),
        ({"hidden_size": "32"}, "hidden_size = '32' is invalid"),
    ):
        hostile = {**spec, "lm_config": {**spec["lm_config"], **change}}
        with pytest.raises(PolicyError, match=message):
            model_from_spec(hostile)
    with pytest.raises(PolicyError, match="lm_config must be an object"):
        model_from_spec({**spec, "lm_config": [1]})


def test_a_causal_lm_policy_plays_token_recall():
    env = make_vector("TokenRecall-v1", 16, seed=0)
    space = env.single_observation_space
    torch.manual_seed(5)
    policy = build_model(tiny("qwen2", vocab_size=8), space, env.single_action_space)
    obs = env.reset()
    for _ in range(8):
        actions, _, _ = policy.act(obs)
        obs = env.step(actions).obs
    assert obs.dtype == np.int64


@pytest.mark.slow
def test_ppo_teaches_a_tiny_causal_lm_token_recall():
    """The task is learnable through the real rollout Collector and PPOLearner: a 2-layer
    Qwen2 of width 32 goes from guessing (1/4) to recalling the token after the marker."""
    from shoal.learner.ppo import PPOConfig, PPOLearner
    from shoal.learner.rollout import Collector

    torch.manual_seed(0)
    env = make_vector("TokenRecall-v1", 64, seed=0)
    model = build_model(tiny("qwen2", vocab_size=8, max_positions=16), env.single_observation_space,
                        env.single_action_space)  # fmt: skip
    learner = PPOLearner(
        model, PPOConfig(lr=2e-3, num_minibatches=4, update_epochs=4, ent_coef=0.0)
    )
    collector = Collector("lm", env, model, 16, "token-recall", seed=1)
    first = collector.collect()
    assert first.obs.dtype == np.int64
    assert first.rewards.mean() < 0.5
    fragment = first
    for version in range(16):
        learner.update([fragment], current_version=version)
        collector.policy_version = version + 1
        fragment = collector.collect()
    assert fragment.rewards.mean() > 0.7


def _config(directory, **changes) -> str:
    values = json.loads((directory / "config.json").read_text())
    values.update(changes)
    return json.dumps({k: v for k, v in values.items() if v is not None})


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00garbage"), "deserializing"),
        (lambda d: (d / "value_head.safetensors").write_bytes(b"\x10\x00garbage"),
         "deserializing"),
        (lambda d: (d / "config.json").write_text("[1]"), "not a JSON object"),
        (lambda d: (d / "config.json").write_text("[" * 100_000), "not a JSON config"),
        (lambda d: (d / "config.json").write_bytes(b" " * (2**20 + 1)), "larger than 1 MiB"),
        (lambda d: (d / "config.json").write_text(_config(d, vocab_size=None)), "vocab_size = None"),
        (lambda d: (d / "config.json").write_text(_config(d, max_position_embeddings="abc")),
         "max_position_embeddings = 'abc'"),
        (lambda d: (d / "config.json").write_text(_config(d, layer_types=["x"])),
         "not a valid qwen2 config"),
        (lambda d: ((d / "config.json").unlink(), os.mkfifo(d / "config.json")),
         "not a regular file"),
    ],
)  # fmt: skip
def test_a_hostile_directory_is_one_policy_error_built_whole_or_deferred(tmp_path, damage, said):
    from shoal.learner.materialize import build_policy

    torch.manual_seed(0)
    directory = export_pretrained(build_model(tiny("qwen2"), TOKENS, spaces.Discrete(5)), tmp_path)
    damage(directory)
    cfg = ModelConfig(family="causal-lm", path=str(directory))
    for build in (build_model, lambda c, o, a: build_policy(c, o, a, torch.device("cpu"))):
        with pytest.raises(PolicyError, match=re.escape(said)):
            build(cfg, TOKENS, spaces.Discrete(5))


def test_a_directory_missing_a_tensor_is_refused_not_filled_with_random_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    directory = export_pretrained(build_model(tiny("qwen2"), TOKENS, spaces.Discrete(5)), tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(PolicyError, match=r"missing 'lm_head\.weight'"):
        build_model(
            ModelConfig(family="causal-lm", path=str(directory)), TOKENS, spaces.Discrete(5)
        )
