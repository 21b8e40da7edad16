"""Hypothesis strategies for control-plane commands over a small id universe, so commands collide."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from shoal.raft.model import LIVENESS, TASK_STATES

node_ids = st.sampled_from(["n1", "n2", "n3"])
job_ids = st.sampled_from(["j1", "j2"])
task_ids = st.sampled_from(["t1", "t2", "t3", "t4"])
fault_ids = st.sampled_from(["f1", "f2", "f3"])
op_ids = st.sampled_from([f"op{i}" for i in range(12)])
stamps = st.floats(min_value=0, max_value=2e9, allow_nan=False, allow_infinity=False)
json_leaf = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=5) | stamps
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
free_object = st.dictionaries(st.text(max_size=4), json_value, max_size=3)

gpu = st.builds(
    lambda i, isl: {"index": i, "uuid": f"GPU-{i}", "island": isl, "domain": "d0"},
    st.integers(0, 7),
    st.sampled_from(["i0", "i1"]),
)
task_spec = st.builds(
    lambda tid, kind, gpus: {
        "task_id": tid,
        "kind": kind,
        "actor": "shoal.learner.rollout:RolloutActor",
        "args": {},
        "resources": {"cpus": 1.0, "memory": 1024, "gpus": gpus},
    },
    task_ids,
    st.sampled_from(["rollout", "learner-rank"]),
    st.integers(0, 2),
)
gpu_indices = st.lists(st.integers(0, 8), max_size=3, unique=True)
published_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
published_state = st.dictionaries(st.text(min_size=1, max_size=8), published_leaf, max_size=4)
"""A flat object within every limit of `commands.PUBLISHED_STATE`."""
restart_spec = st.builds(
    lambda n, w: {"placement": "auto", "restart": {"max_restarts": n, "window_s": w}},
    st.integers(0, 3),
    st.floats(0.5, 1e6),
)


def _unique(items: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    seen: dict[Any, dict[str, Any]] = {}
    for item in items:
        seen.setdefault(item[key], item)
    return list(seen.values())


args_by_op: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "register_node": st.builds(
        lambda n, g, c: {
            "node_id": n,
            "address": f"127.0.0.1:{7000 + len(n)}",
            "resources": {"cpus": c, "memory": 2**30, "gpus": _unique(g, "index")},
            "labels": {"rack": "r1"},
        },
        node_ids,
        st.lists(gpu, max_size=3),
        st.floats(0, 64),
    ),
    "set_liveness": st.builds(
        lambda cs: {"changes": _unique(cs, "node_id")},
        st.lists(
            st.fixed_dictionaries({"node_id": node_ids, "liveness": st.sampled_from(LIVENESS)}),
            max_size=3,
        ),
    ),
    "report_health": st.builds(
        lambda rs: {"reports": _unique(rs, "node_id")},
        st.lists(
            st.fixed_dictionaries(
                {"node_id": node_ids, "health": free_object, "last_heartbeat": stamps}
            ),
            max_size=3,
        ),
    ),
    "set_cordon": st.fixed_dictionaries({"node_id": node_ids, "cordoned": st.booleans()}),
    "set_draining": st.fixed_dictionaries({"node_id": node_ids, "draining": st.booleans()}),
    "submit_job": st.builds(
        lambda j, spec, ts: {"job_id": j, "spec": spec, "tasks": _unique(ts, "task_id")},
        job_ids,
        free_object | restart_spec,
        st.lists(task_spec, max_size=3),
    ),
    "stop_job": st.fixed_dictionaries({"job_id": job_ids}),
    "restart_tasks": st.builds(
        lambda j, cause, others, g, why, counted: {
            "job_id": j,
            "cause": cause,
            "generation": g,
            "tasks": [*others, cause],
            "reason": why,
            "counted": counted,
        },
        job_ids,
        task_ids,
        st.lists(task_ids, max_size=3),
        st.integers(0, 4),
        st.text(max_size=8),
        st.booleans(),
    ),
    "add_tasks": st.builds(
        lambda j, ts: {"job_id": j, "tasks": _unique(ts, "task_id")},
        job_ids,
        st.lists(task_spec, max_size=2),
    ),
    "place_tasks": st.builds(
        lambda ps: {"placements": _unique(ps, "task_id")},
        st.lists(
            st.fixed_dictionaries({"task_id": task_ids, "node_id": st.none() | node_ids})
            | st.fixed_dictionaries(
                {"task_id": task_ids, "node_id": node_ids, "gpus": gpu_indices}
            ),
            max_size=3,
        ),
    ),
    "set_task_state": st.fixed_dictionaries(
        {"task_id": task_ids, "state": st.sampled_from(TASK_STATES)},
        optional={"generation": st.integers(0, 3), "message": st.text(max_size=8)},
    ),
    "migrate_task": st.fixed_dictionaries(
        {"task_id": task_ids, "node_id": node_ids}, optional={"gpus": gpu_indices}
    ),
    "publish_task_state": st.fixed_dictionaries(
        {"task_id": task_ids, "generation": st.integers(0, 4), "state": published_state}
    ),
    "set_pending_reason": st.fixed_dictionaries(
        {
            "task_id": task_ids,
            "generation": st.integers(0, 4),
            "reason": st.sampled_from(["no island", "no room"]),
        }
    ),
    "abandon_incoming": st.fixed_dictionaries(
        {"task_id": task_ids, "generation": st.integers(0, 4), "reason": st.text(max_size=8)}
    ),
    "record_checkpoint": st.fixed_dictionaries(
        {
            "job_id": job_ids,
            "path": st.sampled_from(["/ck/a", "/ck/b"]),
            "step": st.integers(0, 100),
            "sha256": st.just("ab" * 32),
            "complete": st.booleans(),
        }
    ),
    "add_event": st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["note", "chaos"]),
            "message": st.text(max_size=8),
            "fields": free_object,
        }
    ),
    "announce_leader": st.fixed_dictionaries(
        {
            "replica_id": st.sampled_from(["c1", "c2"]),
            "raft": st.just("127.0.0.1:1"),
            "api": st.just("http://127.0.0.1:2"),
            "term": st.integers(0, 5),
        }
    ),
    "barrier": st.just({}),
    "inject_fault": st.one_of(
        st.fixed_dictionaries(
            {"fault_id": fault_ids, "kind": st.just("task-kill"), "target": task_ids},
            optional={"duration_s": st.floats(0, 60)},
        ),
        st.fixed_dictionaries(
            {
                "fault_id": fault_ids,
                "kind": st.just("task-pause"),
                "target": task_ids,
                "duration_s": st.floats(0.1, 60),
            }
        ),
        st.fixed_dictionaries(
            {"fault_id": fault_ids, "kind": st.just("node-kill"), "target": node_ids}
        ),
        st.fixed_dictionaries(
            {
                "fault_id": fault_ids,
                "kind": st.just("gpu-xid"),
                "target": node_ids,
                "gpu": st.integers(0, 8),
            },
            optional={"xid": st.sampled_from([48, 79, 94])},
        ),
        st.fixed_dictionaries(
            {
                "fault_id": fault_ids,
                "kind": st.just("clock-skew"),
                "target": node_ids,
                "offset_s": st.sampled_from([-2.5, 0.5, 30.0]),
                "duration_s": st.floats(0.1, 60),
            }
        ),
    ),
    "report_fault": st.fixed_dictionaries(
        {"fault_id": fault_ids, "state": st.sampled_from(["injected", "healed", "failed"])},
        optional={"message": st.text(max_size=8)},
    ),
}


@st.composite
def commands(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(sorted(args_by_op)))
    return {"op": op, "op_id": draw(op_ids), "at": draw(stamps), "args": draw(args_by_op[op])}


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    members = draw(st.lists(commands(), min_size=1, max_size=4))
    return {"op": "batch", "op_id": draw(op_ids), "at": draw(stamps), "args": {"commands": members}}


any_command = commands() | batches()
