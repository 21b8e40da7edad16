"""`shoal export CHECKPOINT OUT_DIR`: a causal-lm policy as a `save_pretrained` directory."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser(
        "export",
        help="export a causal-lm checkpoint as a transformers save_pretrained directory",
        description="Load the policy of a checkpoint (a checkpoint directory, its manifest, or a "
        "run directory for its newest complete one; any number of ranks may have written it) "
        "and write its language model as a directory that transformers' from_pretrained or an "
        "inference server loads, with the value head beside it.",
    )
    parser.add_argument("checkpoint", type=Path, help="checkpoint or run directory")
    parser.add_argument("out", type=Path, help="the directory to write (created if missing)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shoal.learner.models import export_pretrained
    from shoal.train import load_policy

    model, _, info = load_policy(args.checkpoint)
    out = export_pretrained(model, args.out)
    print(f"exported step {info.step} of {info.path} to {out}")
    return 0
