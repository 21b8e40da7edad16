"""`shoal status [--json]`: the local cluster's processes, their Raft state and the leader, and
the registered nodes with their GPUs, NVLink islands and health collectors (each up, down or
absent, with the reason: e.g. whether DCGM and PTP are there)."""

from __future__ import annotations

import argparse

from shoal.commands.up import add_run_dir


def register(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = verbs.add_parser("status", help="show the local cluster")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_run_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from shoal.local import LocalCluster, default_run_dir
    from shoal.scheduler.health.presence import describe

    local = LocalCluster(args.run_dir or default_run_dir())
    rows = local.status()
    nodes = local.nodes()
    if args.json:
        print(json.dumps({"run_dir": str(local.run_dir), "processes": rows, "nodes": nodes}))
        return 0
    header = ("name", "kind", "pid", "state", "term", "commit", "leader", "api")
    cells = [header] + [
        tuple(
            "-" if r[k] is None else str(r[k])
            for k in ("name", "kind", "pid", "state", "term", "commit_index", "leader", "api")
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    print(f"run dir {local.run_dir}")
    for line in cells:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    if nodes:
        gpus = sum(n["gpus"] for n in nodes)
        print(f"nodes {len(nodes)}, GPUs {gpus}")
        for n in nodes:
            islands = ", ".join(f"{label} ({count})" for label, count in n["islands"].items())
            flag = " cordoned" if n["cordoned"] else ""
            print(f"  {n['id']}  {n['liveness']}{flag}  {n['gpus']} GPUs  {islands or '-'}")
            source = (
                f"; GPU utilisation from {n['gpu_util_source']}" if n["gpu_util_source"] else ""
            )
            print(f"    health: {describe(n['collectors'])}{source}")
    return 0
