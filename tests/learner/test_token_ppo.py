"""Token PPO/GRPO: advantage properties, the one-forward token outputs, the decoupled weights,
the KL penalty, learning on a tiny Qwen2, PPOLearner's dispatch and groups through the intake."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shoal.errors import ConfigError
from shoal.learner.buffer import Admission, Intake
from shoal.learner.errors import BadFragment
from shoal.learner.generation import Generator, SamplingConfig
from shoal.learner.models import CausalLMPolicy, ModelConfig, build_model
from shoal.learner.ppo import PPOConfig, PPOLearner
from shoal.learner.sequences import SequenceFragment, fragment_from_wire
from shoal.learner.token_advantages import grpo_advantages, token_gae
from shoal.learner.token_config import TokenRLConfig
from shoal.learner.token_ppo import TokenPPO, build_token_batch, normalise_loss, token_outputs
from shoal.runtime import wire
from tests.learner.test_fragment import make_fragment
from tests.support.sequences import from_completions, make_sequences

VOCAB, PAD, EOS = 16, 14, 15
GROUP = 4


class TinyTokenizer:
    """Ids 0..13 are 'letters', 14 pads, 15 ends a completion."""

    pad_id, eos_id = PAD, EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) % PAD for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i < PAD)


def tiny_policy(seed: int = 0) -> CausalLMPolicy:
    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                 intermediate_size=64, max_positions=64)  # fmt: skip
    cfg = ModelConfig(family="causal-lm", arch="qwen2", **sizes)
    obs = spaces.Box(0, VOCAB - 1, shape=(32,), dtype=np.int64)
    model = build_model(cfg, obs, spaces.Discrete(VOCAB))
    assert isinstance(model, CausalLMPolicy)
    return model


def rewarded(completion: list[int]) -> float:
    """The toy task: a completion is right when its first token is one of ids 0..6."""
    return float(completion[0] < 7)


def sample(policy: CausalLMPolicy, temperature: float, seed: int, version: int = 0):
    """GROUP samples of 4 prompts from the real generator, scored by `rewarded`."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, PAD, size=3).tolist() for _ in range(4) for _ in range(GROUP)]
    for i in range(0, len(prompts), GROUP):
        prompts[i : i + GROUP] = [prompts[i]] * GROUP
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=5)
    done = Generator(policy, TinyTokenizer(), cfg, seed=seed).generate(prompts, version)
    rewards = [rewarded(done.tokens[i, : done.lengths[i]].tolist()) for i in range(len(prompts))]
    return from_completions(prompts, done, rewards, GROUP, PAD)


def row_logprobs(policy: CausalLMPolicy, frag: SequenceFragment, temperature: float) -> np.ndarray:
    """Each completion's summed log-prob [N] under `policy`."""
    with torch.no_grad():
        out = token_outputs(
            policy,
            torch.from_numpy(frag.tokens),
            torch.from_numpy(frag.prompt_lengths),
            torch.from_numpy(frag.completion_lengths),
            temperature,
        )
    rows = np.repeat(np.arange(frag.num_envs), frag.completion_lengths)
    return np.bincount(rows, weights=out.logprobs.numpy(), minlength=frag.num_envs)


# -- advantages --------------------------------------------------------------------------------

_REWARDS = hnp.arrays(np.float32, st.integers(1, 24), elements=st.floats(-10, 10, width=32))


@given(rewards=_REWARDS, data=st.data())
@settings(max_examples=200, deadline=None)
def test_grpo_advantages_have_zero_mean_and_unit_spread_per_group(rewards, data):
    groups = data.draw(hnp.arrays(np.int64, rewards.shape, elements=st.integers(0, 4)))
    adv = grpo_advantages(rewards, groups, eps=1e-6)
    assert adv.shape == rewards.shape
    assert adv.dtype == np.float32
    for g in np.unique(groups):
        in_group = adv[groups == g].astype(np.float64)
        assert abs(in_group.mean()) < 1e-4
        spread = rewards[groups == g].astype(np.float64).std()
        if spread > 1e-2:
            assert in_group.std() == pytest.approx(1.0, abs=1e-3)


@given(
    reward=st.floats(-10, 10, width=32),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
)
@settings(max_examples=100, deadline=None)
def test_grpo_advantages_are_zero_when_a_group_agrees(reward, sizes):
    groups = np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)
    rewards = np.full(groups.shape, reward, np.float32)
    assert not grpo_advantages(rewards, groups, eps=1e-6).any()


def _completions(data: st.DataObject, n: int, length: int) -> np.ndarray:
    prompt = data.draw(hnp.arrays(np.int64, (n,), elements=st.integers(1, length - 1)))
    room = length - prompt
    completion = np.array([data.draw(st.integers(1, int(r))) for r in room])
    position = np.arange(length)[None, :]
    return (position >= prompt[:, None]) & (position < (prompt + completion)[:, None])


@given(data=st.data(), n=st.integers(1, 5), length=st.integers(2, 9))
@settings(max_examples=100, deadline=None)
def test_token_gae_is_the_monte_carlo_return_at_lambda_one_and_td_at_zero(data, n, length):
    mask = _completions(data, n, length)
    floats = st.floats(-5, 5, width=32)
    values = np.where(mask, data.draw(hnp.arrays(np.float32, (n, length), elements=floats)), 0)
    rewards = data.draw(hnp.arrays(np.float32, (n,), elements=floats))
    adv, ret = token_gae(rewards, values.astype(np.float32), mask, gamma=1.0, lam=1.0)
    assert not adv[~mask].any()
    assert not ret[~mask].any()
    np.testing.assert_allclose(
        ret[mask], np.broadcast_to(rewards[:, None], mask.shape)[mask], atol=1e-4
    )
    td, _ = token_gae(rewards, values.astype(np.float32), mask, gamma=1.0, lam=0.0)
    for i in range(n):
        v = values[i, mask[i]]
        expected = np.append(v[1:], 0.0) - v
        expected[-1] += rewards[i]
        np.testing.assert_allclose(td[i, mask[i]], expected, atol=1e-4)


def test_token_mean_weighs_every_token_and_sequence_mean_every_completion():
    per_token = torch.tensor([4.0, 1.0, 1.0, 1.0])  # a 1-token completion, then a 3-token one
    lengths = torch.tensor([1, 3])
    assert normalise_loss(per_token, lengths, "token").item() == pytest.approx(7 / 4)
    assert normalise_loss(per_token, lengths, "sequence").item() == pytest.approx((4 + 1) / 2)


# -- the forward and the batch ----------------------------------------------------------------


def test_one_padded_forward_equals_each_row_alone():
    policy = tiny_policy()
    frag = make_sequences(groups=3, group_size=2, vocab=VOCAB, max_prompt=5, max_completion=6)
    args = [
        torch.from_numpy(a) for a in (frag.tokens, frag.prompt_lengths, frag.completion_lengths)
    ]
    with torch.no_grad():
        together = token_outputs(policy, *args, temperature=0.8)
        start = 0
        for i in range(frag.num_envs):
            p, c = int(frag.prompt_lengths[i]), int(frag.completion_lengths[i])
            alone = token_outputs(
                policy, args[0][i : i + 1, : p + c], args[1][i : i + 1], args[2][i : i + 1], 0.8
            )
            for name in ("logprobs", "entropy", "values"):
                np.testing.assert_allclose(
                    getattr(together, name)[start : start + c], getattr(alone, name), atol=1e-5
                )
            start += c
    assert start == frag.num_steps == together.logprobs.numel()


def test_token_index_follows_any_row_order():
    policy = tiny_policy()
    frags = [make_sequences(vocab=VOCAB, seed=s, group_size=GROUP) for s in range(2)]
    batch = build_token_batch(frags, TokenRLConfig(group_size=GROUP), torch.device("cpu"))
    ppo = TokenPPO(policy, TokenRLConfig(group_size=GROUP))
    with torch.no_grad():
        everything = ppo.outputs(policy, batch, torch.arange(batch.rows)).logprobs
        rows = torch.randperm(batch.rows, generator=torch.Generator().manual_seed(1))[:5]
        some = ppo.outputs(policy, batch, rows).logprobs
    torch.testing.assert_close(some, everything[batch.token_index(rows)])


# -- the decoupled correction and the KL penalty -----------------------------------------------


@pytest.mark.parametrize("minibatches", [1, 2])
def test_on_policy_weights_are_one_when_the_temperature_matches_the_generators(minibatches):
    policy = tiny_policy()
    frag = sample(policy, temperature=0.7, seed=3)
    mask = frag.completion_mask()
    behaviour = frag.logprobs[mask]
    rows = np.repeat(np.arange(frag.num_envs), frag.completion_lengths)
    same = row_logprobs(policy, frag, 0.7)
    np.testing.assert_allclose(same, np.bincount(rows, weights=behaviour), atol=1e-4)
    other = row_logprobs(policy, frag, 1.0)
    assert np.abs(other - np.bincount(rows, weights=behaviour)).max() > 1e-2
    cfg = TokenRLConfig(group_size=GROUP, temperature=0.7, num_minibatches=minibatches, lr=1e-3)
    metrics = TokenPPO(policy, cfg).update([frag], current_version=0)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["is_weight_capped_frac"] == 0.0
    assert metrics["num_steps"] == frag.num_steps


@pytest.mark.parametrize(
    ("shift", "weight", "capped"), [(-5.0, 2.0, 1.0), (0.25, np.exp(-0.25), 0.0)]
)
def test_the_importance_weight_is_prox_over_behaviour_capped(shift, weight, capped):
    """μ = π_prox·e^shift on every token: the weight is min(e^−shift, is_cap = 2)."""
    policy = tiny_policy()
    frag = make_sequences(vocab=VOCAB, group_size=GROUP, seed=2)
    mask = frag.completion_mask()
    with torch.no_grad():
        prox = token_outputs(
            policy,
            *(
                torch.from_numpy(a)
                for a in (frag.tokens, frag.prompt_lengths, frag.completion_lengths)
            ),
            1.0,
        ).logprobs.numpy()
    assert prox.max() < -0.25
    logprobs = np.zeros_like(frag.logprobs)
    logprobs[mask] = prox + shift
    frag = SequenceFragment(**{**vars(frag), "logprobs": logprobs})
    metrics = TokenPPO(policy, TokenRLConfig(group_size=GROUP, is_cap=2.0)).update([frag], 0)
    assert metrics["is_weight_mean"] == pytest.approx(weight, rel=1e-4)
    assert metrics["is_weight_capped_frac"] == capped


def test_kl_to_the_reference_is_zero_until_the_policy_moves():
    policy = tiny_policy()
    frag = sample(policy, temperature=1.0, seed=4)
    cfg = TokenRLConfig(group_size=GROUP, kl_coef=0.1, lr=1e-2)
    ppo = TokenPPO(policy, cfg)
    assert ppo.reference is not None
    assert not any(p.requires_grad for p in ppo.reference.parameters())
    first = ppo.update([frag], current_version=0)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    later = [ppo.update([frag], current_version=0)["kl_ref"] for _ in range(3)]
    assert later[-1] > 1e-5


def test_staleness_is_measured_per_token_and_future_stamps_are_refused():
    policy = tiny_policy()
    frag = make_sequences(vocab=VOCAB, group_size=GROUP, version=2)
    versions = frag.versions.copy()
    versions[0, versions[0] >= 0] = 4  # row 0 resumed on version 4 after a weight swap
    frag = SequenceFragment(**{**vars(frag), "versions": versions})
    metrics = TokenPPO(policy, TokenRLConfig(group_size=GROUP)).update([frag], current_version=5)
    lags = 5 - versions[frag.completion_mask()]
    assert metrics["policy_lag_max"] == 3
    assert metrics["policy_lag_mean"] == pytest.approx(lags.mean())
    assert metrics["policy_lag_hist_1"] == frag.completion_lengths[0]
    with pytest.raises(BadFragment, match="newer than the learner's 3"):
        TokenPPO(policy, TokenRLConfig(group_size=GROUP)).update([frag], current_version=3)


# -- learning ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algo", "loss_norm"), [("grpo", "token"), ("ppo", "token"), ("grpo", "sequence")]
)
def test_a_few_updates_raise_the_log_prob_of_rewarded_completions(algo, loss_norm):
    policy = tiny_policy(seed=1)
    frag = sample(policy, temperature=1.0, seed=5)
    good = frag.rewards > 0
    assert 0 < good.sum() < frag.num_envs
    before = row_logprobs(policy, frag, 1.0)
    cfg = TokenRLConfig(
        algo=algo,
        group_size=GROUP,
        loss_norm=loss_norm,
        lr=3e-3,
        num_minibatches=2,
        update_epochs=2,
    )
    ppo = TokenPPO(policy, cfg)
    for _ in range(4):
        metrics = ppo.update([frag], current_version=0)
    after = row_logprobs(policy, frag, 1.0)
    assert (after[good] - before[good]).mean() > 1.0
    assert (after[~good] - before[~good]).mean() < 0
    assert np.isfinite(metrics["loss"])
    if algo == "ppo":
        assert "value_loss" in metrics


# -- PPOLearner dispatch ----------------------------------------------------------------------


def test_ppo_learner_dispatches_sequence_fragments_to_the_token_update():
    policy = tiny_policy()
    learner = PPOLearner(policy, PPOConfig(num_minibatches=2, update_epochs=1, lr=1e-3))
    learner.token_cfg = TokenRLConfig.from_ppo(learner.cfg, group_size=GROUP, temperature=0.7)
    frag = sample(policy, temperature=0.7, seed=6)
    weights = copy.deepcopy(policy.state_dict())
    metrics = learner.update([frag, sample(policy, 0.7, seed=7)], current_version=0)
    assert metrics["num_sequences"] == 2 * frag.num_envs
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["policy_lag_median"] == 0
    assert learner.optimizer.state  # the learner's own optimiser stepped
    assert any(not torch.equal(weights[k], v) for k, v in policy.state_dict().items())
    with pytest.raises(BadFragment, match="cannot mix"):
        learner.update([frag, make_fragment()], current_version=0)


def test_a_fragment_read_off_the_wire_trains_without_copies_or_warnings():
    """Wire arrays are read-only views of the frame; the update must not write to them."""
    frag = sample(tiny_policy(), temperature=1.0, seed=8)
    frame = b"".join(bytes(part) for part in wire.encode(frag.to_wire()).parts)
    back = fragment_from_wire(wire.decode(frame), vocab_size=VOCAB)
    assert isinstance(back, SequenceFragment)
    assert not back.tokens.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = TokenPPO(tiny_policy(), TokenRLConfig(group_size=GROUP)).update([back], 0)
    assert metrics["num_steps"] == frag.num_steps


def test_token_update_refuses_what_the_policy_cannot_score():
    policy = tiny_policy()
    ppo = TokenPPO(policy, TokenRLConfig(group_size=GROUP))
    with pytest.raises(BadFragment, match="vocabulary has 16 ids"):
        ppo.update([make_sequences(vocab=40, group_size=GROUP)], current_version=0)
    with pytest.raises(BadFragment, match=r"3 rows in group 0, token\.group_size is 4"):
        ppo.update([make_sequences(vocab=VOCAB, group_size=3)], current_version=0)
    long = make_sequences(vocab=VOCAB, max_prompt=200, max_completion=8, group_size=GROUP, seed=1)
    assert (long.prompt_lengths + long.completion_lengths).max() > 64
    with pytest.raises(BadFragment, match="64 positions"):
        ppo.update([long], current_version=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"algo": "a2c"}, "token.algo"),
        ({"group_size": 1}, "token.group_size"),
        ({"group_size": True}, "token.group_size"),
        ({"temperature": 0}, "token.temperature"),
        ({"lr": float("nan")}, "token.lr"),
        ({"is_cap": 0.5}, "token.is_cap"),
        ({"gae_lambda": 1.5}, "token.gae_lambda"),
        ({"kl_coef": -1}, "token.kl_coef"),
        ({"loss_norm": "row"}, "token.loss_norm"),
        ({"norm_adv": "yes"}, "token.norm_adv"),
    ],
)
def test_hostile_configs_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TokenRLConfig(**kwargs)


def test_from_ppo_shares_the_step_hyper_parameters_but_not_the_discount():
    ppo = PPOConfig(lr=7e-4, clip_coef=0.3, is_cap=3.0, gamma=0.9, num_minibatches=2)
    cfg = TokenRLConfig.from_ppo(ppo, algo="ppo", group_size=2)
    assert (cfg.lr, cfg.clip_coef, cfg.is_cap, cfg.num_minibatches) == (7e-4, 0.3, 3.0, 2)
    assert cfg.gamma == 1.0


# -- groups through the intake ----------------------------------------------------------------


@given(
    plan=st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
@settings(max_examples=60, deadline=None)
def test_prompts_in_a_group_stay_together_through_the_intake(plan):
    """Fragments of whole groups, offered at various versions while the learner advances:
    every group is trained on whole (all GROUP rows, one prompt) or dropped whole."""
    intake = Intake(capacity=64, max_staleness=1)
    seqs = {"a": 0, "b": 0}
    offered: dict[tuple[str, int], np.ndarray] = {}
    taken: list[SequenceFragment] = []
    for actor, lag, advance in plan:
        version = max(0, intake.version - lag)
        frag = make_sequences(
            groups=2, group_size=GROUP, vocab=VOCAB, version=version, actor_id=actor,
            seq=seqs[actor], seed=len(offered), first_group=2 * seqs[actor],
        )  # fmt: skip
        seqs[actor] += 1
        for g in np.unique(frag.groups):
            offered[(actor, int(g))] = frag.tokens[frag.groups == g]
        assert intake.offer(frag) in (Admission.ACCEPTED, Admission.STALE)
        if advance:
            taken.extend(intake.take(2))
            intake.set_version(intake.version + 1)
    taken.extend(intake.take(len(intake)))
    rows: dict[tuple[str, int], int] = {}
    for frag in taken:
        for g in np.unique(frag.groups):
            key = (frag.actor_id, int(g))
            assert key not in rows  # a group arrives in one fragment, once
            rows[key] = int((frag.groups == g).sum())
            group_tokens = frag.tokens[frag.groups == g]
            p = int(frag.prompt_lengths[frag.groups == g][0])
            assert (group_tokens[:, :p] == offered[key][:, :p]).all()
    assert set(rows.values()) <= {GROUP}
    totals = intake.totals()
    assert totals["trained"] == len(taken)
    assert totals["trained_steps"] == sum(f.num_steps for f in taken)
    assert totals["trained"] + totals["dropped_stale"] == len(plan)
