"""`shoal envs list|info|hash|diff`: the environment ecosystem from the command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from shoal.errors import ShoalError


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("envs", help="list, describe, hash and compare environments")
    actions = parser.add_subparsers(dest="envs_action", metavar="ACTION")
    actions.required = True

    listing = actions.add_parser(
        "list",
        help="environments that really make, reset and step here, and whether each trains "
        "with the default model (probed, then cached)",
    )
    listing.add_argument("--json", action="store_true", help="print JSON objects instead")
    listing.add_argument("--all", action="store_true", help="include ids whose probe failed")
    listing.add_argument("--refresh", action="store_true", help="probe again, ignoring the cache")
    listing.add_argument("--no-gym", action="store_true", help="only shoal's own environments")
    listing.add_argument("--workers", type=int, default=2, help="probe subprocesses (default 2)")
    listing.add_argument("--timeout", type=float, default=30.0, help="seconds allowed per probe")
    listing.set_defaults(func=run_list)

    info = actions.add_parser("info", help="what an id makes: entry point, spaces, time limit")
    info.add_argument("env_id", metavar="ID")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=run_info)

    hashing = actions.add_parser("hash", help="the environment hash (manifest kept in SHOAL_HOME)")
    hashing.add_argument("env_id", metavar="ID")
    hashing.add_argument("--kwargs", nargs="*", default=[], metavar="K=V", help="parameters")
    hashing.add_argument("--seed", type=int, default=None)
    hashing.add_argument("--json", action="store_true", help="print the hash with its manifest")
    hashing.set_defaults(func=run_hash)

    diff = actions.add_parser("diff", help="name each field in which two environment hashes differ")
    diff.add_argument("first", metavar="H1")
    diff.add_argument("second", metavar="H2")
    diff.add_argument("--json", action="store_true", help="print the differing fields as JSON")
    diff.set_defaults(func=run_diff)


class BadKwarg(ShoalError):
    """A --kwargs item is not KEY=VALUE."""


def parse_kwargs(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; a VALUE that parses as JSON (10, 0.5, true, [1,2]) is taken as such."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise BadKwarg(f"--kwargs expects KEY=VALUE (e.g. size=10), got {item!r}")
        try:
            parsed[key] = json.loads(text)
        except ValueError:
            parsed[key] = text
    return parsed


_VARIANT = re.compile(r"(-ram)?(NoFrameskip|Deterministic)?(-v\d+)?$")


def family(env_id: str) -> str:
    """An id without namespace, version and Atari frame-skip/RAM variant: one game, one family."""
    name = env_id.removeprefix("gym:").removeprefix("ALE/")
    return _VARIANT.sub("", name).lower()


TRAINS_CHECK = "shoal.learner.preflight:trainable"
"""What "trains" means in the list: `shoal train <id>` with every default passes its pre-flight
(the auto preset's wrappers, the auto model built for the spaces)."""


def run_list(args: argparse.Namespace) -> int:
    from shoal.envs import list as list_ids
    from shoal.envs.catalog import catalog_path, load_catalog

    ids = list_ids(include_gym=not args.no_gym)
    print(f"probing environments (results cached in {catalog_path()}) ...", file=sys.stderr)
    results = load_catalog(
        ids, refresh=args.refresh, workers=args.workers, timeout=args.timeout, check=TRAINS_CHECK
    )
    shown = results if args.all else [r for r in results if r.ok]
    working = [r.id for r in results if r.ok]
    training = [r.id for r in results if r.ok and r.trains]
    if args.json:
        keys = ("id", "ok", "detail", "trains", "trains_detail")
        print(json.dumps([{k: getattr(r, k) for k in keys} for r in shown]))
        return 0
    width = max((len(r.id) for r in shown), default=2)
    for result in shown:
        print(f"{result.id.ljust(width)}  {_column(result)}")
    print(
        f"{len(working)} environments make, reset and step here "
        f"({len({family(i) for i in working})} distinct after folding versions and Atari "
        f"variants; {len(results) - len(working)} of {len(results)} registered ids failed"
        f"{'' if args.all else ', --all shows them'}); {len(training)} of them train with the "
        f"default model ({len({family(i) for i in training})} distinct)"
    )
    return 0


def _column(result: Any) -> str:
    """`ok  trains`, `ok  steps only: <why>`, or why the probe failed."""
    if not result.ok:
        return str(result.detail)
    return "ok  trains" if result.trains else f"ok  steps only: {result.trains_detail}"


def run_info(args: argparse.Namespace) -> int:
    from shoal.envs import make, spec
    from shoal.envs.hashing import package_version

    env_spec = spec(args.env_id)
    env = make(env_spec.id)
    try:
        info = {
            "id": env_spec.id,
            "entry_point": env_spec.entry_point_name,
            "vector": "native batched" if env_spec.vector_entry_point else "VectorRunner",
            "kwargs": dict(env_spec.kwargs),
            "max_episode_steps": env_spec.max_episode_steps,
            "observation_space": str(env.observation_space),
            "action_space": str(env.action_space),
            "requirements": {name: package_version(name) for name in env_spec.requirements},
            "description": env_spec.description,
        }
    finally:
        env.close()
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key + ':':<19} {value}")
    return 0


def run_hash(args: argparse.Namespace) -> int:
    from shoal.config import check_int
    from shoal.envs.hashing import env_hash, env_manifest
    from shoal.learner.config import SEED_MAX

    if args.seed is not None:
        check_int("--seed", args.seed, 0, SEED_MAX)
    kwargs = parse_kwargs(args.kwargs)
    _make_once(args.env_id, kwargs)
    digest = env_hash(args.env_id, kwargs, args.seed)
    if args.json:
        print(
            json.dumps({"hash": digest, "manifest": env_manifest(args.env_id, kwargs, args.seed)})
        )
    else:
        print(digest)
    return 0


def _make_once(env_id: str, kwargs: dict[str, Any]) -> None:
    """A hash names an environment that exists: kwargs it does not take (`gravity=3` for a
    CartPole without that parameter) are refused here, not hashed into a manifest."""
    from shoal.envs.registry import make

    make(env_id, **kwargs).close()


def run_diff(args: argparse.Namespace) -> int:
    from shoal.envs.hashing import HashStore, diff_manifests

    store = HashStore.default()
    first, left = store.load(args.first)
    second, right = store.load(args.second)
    lines = diff_manifests(left, right)
    if args.json:
        print(json.dumps({"first": first, "second": second, "differences": lines}))
        return 0
    if not lines:
        print(f"{first[:12]} and {second[:12]} describe the same environment")
    for line in lines:
        print(line)
    return 0
