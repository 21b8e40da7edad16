"""A causal-LM policy end to end: 2 gloo ranks under FSDP2 train it with PPO, each rank sends
the rows it holds of each version to both rollout workers in several buckets, the sharded checkpoint exports as a
transformers directory that `from_pretrained` loads, and a second job trains on from that
directory (`model.path`: each rank builds the LM on the meta device and reads its own rows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

JOB = """
env_id = "TokenRecall-v1"
max_env_steps = 3072
target_return = 100000
time_limit_s = 400
[model]
family = "causal-lm"
arch = "qwen2"
hidden_size = 32
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 64
vocab_size = 64
[learner]
ranks = 2
sharding = "fsdp"
[rollout]
workers = 2
num_envs = 16
horizon = 16
[weight_sync]
bucket_mb = 0.02
"""


def train(job_text: str, tmp_path: Path, name: str) -> Path:
    """`shoal train` of `job_text` on the embedded cluster, stopped unsolved at max_env_steps."""
    job = tmp_path / f"{name}.toml"
    job.write_text(job_text)
    run_dir = tmp_path / name
    argv = [
        sys.executable, "-m", "shoal", "train", str(job), "--embedded", "--run-dir",
        str(run_dir), "--no-eval", "--quiet", "--json",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=550)
    assert done.returncode == 1, done.stderr[-3000:]  # stopped unsolved at max_env_steps
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["stopped_by"] == "max_env_steps"
    return run_dir


def test_a_causal_lm_trains_sharded_and_streams_in_buckets(tmp_path: Path) -> None:
    run_dir = train(JOB, tmp_path, "run")
    held = 0
    for rank in (0, 1):
        status = json.loads((run_dir / f"status-{rank}.json").read_text())
        assert status["parallel"] == "fsdp"
        assert status["version"] >= 2
        sync = status["weight_sync"]
        # Each rank publishes the rows it holds, to both workers (its own and its peer's).
        assert (sync["part"], sync["parts"]) == (rank, 2)
        assert sync["completed"] >= 4
        assert sync["timed_out"] == sync["failed"] == 0
        held += sync["snapshot_bytes"]
        # 20 KiB buckets: each rank's half of this model is three of them.
        assert sync["snapshot_bytes"] > 20 * 2**10
        assert sync["bytes"] >= sync["completed"] * sync["snapshot_bytes"]
    assert held == 4 * 22_849  # its 22,849 values once, split between the ranks, in float32

    out = tmp_path / "exported"
    exported = subprocess.run(
        [sys.executable, "-m", "shoal", "export", str(run_dir), str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert lm.config.vocab_size == 64
    assert (out / "value_head.safetensors").is_file()

    sized = ("arch", "hidden_size", "num_", "intermediate_size", "vocab_size", "max_env_steps")
    kept = "\n".join(line for line in JOB.splitlines() if not line.startswith(sized))
    again = kept.replace("[model]", f"max_env_steps = 1024\n[model]\npath = {json.dumps(str(out))}")
    second = train(again, tmp_path, "again")
    for rank in (0, 1):
        status = json.loads((second / f"status-{rank}.json").read_text())
        assert status["parallel"] == "fsdp"
        assert status["version"] >= 1
