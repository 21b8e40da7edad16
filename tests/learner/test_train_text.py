"""`shoal train` on text environments, on the embedded cluster: rollout workers sample completions
from a tiny causal LM and score them in the sandbox, the learner trains on SequenceFragments, and
the run ends with a checkpoint. A model that writes only hostile programs trains too, with no
rollout worker restarted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shoal.cli import main
from shoal.envs.codegen import CodeGenEnv
from shoal.learner.models.causal_lm import export_pretrained
from tests.support.hostile_lm import HOSTILE, trained_to_write

pytestmark = pytest.mark.timeout(600)

JOB = """
env_id = "{env_id}"
max_env_steps = {steps}
time_limit_s = 300
[model]
{model}
[rollout]
workers = 1
num_envs = 8
[text]
max_new_tokens = {max_new}
[token]
group_size = 4
[checkpoint]
interval_s = 5
"""
TINY = "hidden_size = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64"


def _train(tmp_path: Path, job: str, *extra: str) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(the JSON summary, rank 0's status, the run directory) of one `shoal train` run."""
    path = tmp_path / "job.toml"
    path.write_text(job)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "shoal", "train", str(path), "--embedded", "--run-dir",
        str(run_dir), "--quiet", "--json", *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=550)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    status = json.loads((run_dir / "status-0.json").read_text())
    return summary, status, run_dir


def _assert_trained(summary: dict[str, Any], status: dict[str, Any], run_dir: Path) -> None:
    assert summary["stopped_by"] == "max_env_steps"
    assert summary["restarts"] == 0
    assert summary["intake"]["trained"] >= 2
    assert summary["intake"]["lost"] == summary["intake"]["duplicates"] == 0
    assert status["version"] >= 2  # updates happened
    assert status["metrics"]["num_sequences"] == 8
    assert 0 <= status["metrics"]["reward_mean"] <= 1
    assert Path(summary["checkpoint"]).is_dir()
    assert Path(summary["checkpoint"]).is_relative_to(run_dir)


def test_shoal_train_codeexec_trains_on_the_embedded_cluster(tmp_path: Path) -> None:
    job = JOB.format(env_id="CodeExec-v1", steps=1500, model=TINY, max_new=32)
    summary, status, run_dir = _train(tmp_path, job)
    _assert_trained(summary, status, run_dir)
    assert summary["env_id"] == "CodeExec-v1"
    spec = json.loads((run_dir / "job.json").read_text())["config"]
    assert spec["model"]["family"] == "causal-lm"  # `auto` became the causal LM
    assert spec["model"]["vocab_size"] == 259  # the byte tokenizer's
    report = json.loads(Path(summary["report"]).read_text())  # pass@k of the final checkpoint
    result = report["policies"]["policy"]["train"]
    assert set(result["pass_at"]) == {"1", "4"}
    assert sum(result["outcomes"].values()) == result["tasks"] * result["samples_per_task"]

    # The same run directory with a larger budget resumes from its checkpoint (a GRPO run's
    # value head, which no loss reaches, has optimiser state to restore too).
    (tmp_path / "job.toml").write_text(job.replace("max_env_steps = 1500", "max_env_steps = 3000"))
    resumed, status2, _ = _train(tmp_path, (tmp_path / "job.toml").read_text(), "--no-eval")
    assert resumed["restarts"] == 0
    starts = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    learner = [e for e in starts if e.get("event") == "start" and e.get("process") == "learner"]
    assert learner[-1]["resumed_from"] == summary["checkpoint"]
    assert status2["version"] > status["version"]

    # `shoal eval` on the run evaluates the text policy with the config it was trained with.
    out = tmp_path / "eval"
    argv = [sys.executable, "-m", "shoal", "eval", str(run_dir), "--episodes", "2", "--out",
            str(out), "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = json.loads(done.stdout.strip().splitlines()[-1])
    assert evaluated["env_id"] == "CodeExec-v1"
    assert 0 <= evaluated["mean_reward"] <= 1
    report = json.loads((out / "report.json").read_text())
    assert report["policies"]["policy"]["train"]["tasks"] == 2


def test_codegen_trains_on_two_learner_ranks_sharded(tmp_path: Path) -> None:
    """The token update goes through the FSDP2 wrapper: a 2-rank text job trains end to end."""
    job = JOB.format(env_id="CodeGen-v1", steps=1500, model=TINY, max_new=24)
    job = job.replace("workers = 1", "workers = 2") + '[learner]\nranks = 2\nsharding = "fsdp"\n'
    summary, status, run_dir = _train(tmp_path, job, "--no-eval")
    _assert_trained(summary, status, run_dir)
    other = json.loads((run_dir / "status-1.json").read_text())
    assert other["version"] == status["version"]  # the ranks stepped together


def test_a_model_writing_hostile_programs_never_breaks_a_rollout_worker(tmp_path: Path) -> None:
    with CodeGenEnv(max_new_tokens=64, workers=1) as env:
        policy = trained_to_write(env, list(HOSTILE.values()))
    model_dir = export_pretrained(policy, tmp_path / "hostile")
    job = JOB.format(
        env_id="CodeGen-v1",
        steps=1500,
        model=f'family = "causal-lm"\npath = "{model_dir}"',
        max_new=64,
    )
    summary, status, run_dir = _train(tmp_path, job, "--no-eval")
    _assert_trained(summary, status, run_dir)
    assert status["rejected"] == 0
    returns = sorted(status["returns"])
    assert returns[len(returns) // 2] == 0  # most samples were hostile and scored 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--envs", "6"], "rollout.num_envs = 6 is invalid with token.group_size = 4"),
        (["--model", "mlp"], "model.family = 'mlp' cannot write text"),
        (["--group-size", "1"], "token.group_size = 1 is invalid"),
        (["--tokenizer", "/no/such/dir"], "/no/such/dir"),
    ],
)
def test_a_bad_text_job_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    run_dir = tmp_path / "r"
    assert main(["train", "CodeExec-v1", *flags, "--embedded", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert message in err
    assert not run_dir.exists()


def test_prompts_longer_than_the_models_positions_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.toml"
    job.write_text('env_id = "CodeGen-v1"\n[model]\nmax_positions = 128\n')
    assert main(["train", str(job), "--embedded", "--run-dir", str(tmp_path / "r")]) == 2
    assert "model.max_positions = 128 is invalid" in capsys.readouterr().err


def test_a_parameter_no_loss_reached_is_checkpointed_with_state() -> None:
    """GRPO never reaches the value head; its optimiser state is still saved (what a restore
    expects), and the stepped parameters' state and values are left exactly as they were."""
    import torch
    from torch import nn

    from shoal.learner.train_state import model_optimizer_state

    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 1)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    model["used"](torch.ones(4, 3)).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state[model["used"].weight]["exp_avg"].clone()
    state = model_optimizer_state(model, optimizer)["optimizer"]
    assert {"unused.weight", "unused.bias", "used.weight"} <= set(state)
    assert float(state["used.weight"]["step"]) == 1
    torch.testing.assert_close(optimizer.state[model["used"].weight]["exp_avg"], moments)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert optimizer.param_groups[0]["lr"] == 0.1
