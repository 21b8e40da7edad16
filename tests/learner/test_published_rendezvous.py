"""A group with no fixed port meets where rank 0 published: two real gloo ranks in two processes,
with this test in the node daemon's place (it forwards what each rank publishes into the other's
peers.json, as the agent and the coordinators do between hosts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shoal.errors import ConfigError
from shoal.files import write_json_atomically
from shoal.learner.group import (
    GroupError,
    GroupSpec,
    LearnerGroup,
    bind_collectives_to,
    interface_of,
)
from shoal.learner.peers import Publication, PublishedRendezvous, learner_address
from shoal.task_exchange import PEERS, PUBLISHED, read_peers
from tests.support.waiting import eventually

_RANK = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from shoal.learner.group import GroupSpec, LearnerGroup
    from shoal.learner.peers import Publication, PublishedRendezvous

    spec = GroupSpec.from_env()
    publication = Publication(role="learner", rank=spec.rank, epoch=spec.epoch)
    publication.update(address=f"shoal://127.0.0.1:{7000 + spec.rank}")
    group = LearnerGroup(spec, PublishedRendezvous(publication, spec.epoch))
    group.join()
    total = torch.tensor([float(spec.rank + 1)])
    dist.all_reduce(total)
    group.leave()
    print(int(total.item()))
    """
)


def _relay(dirs: list[Path], generation: int) -> bool:
    """Copy every rank's published state into every rank's peers.json; True once all published."""
    tasks = []
    for rank, directory in enumerate(dirs):
        path = directory / PUBLISHED
        if path.exists():
            published = json.loads(path.read_text())
            tasks.append(
                {
                    "id": f"job-learner-{rank}",
                    "generation": generation,
                    "node": "n1",
                    "state": "running",
                    "published": published,
                }
            )
    for directory in dirs:
        write_json_atomically(directory / PEERS, {"tasks": tasks}, durable=False)
    return len(tasks) == len(dirs)


@pytest.mark.timeout(180)
def test_two_ranks_meet_at_the_port_rank_0_published(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    dirs = [tmp_path / f"task-{rank}" for rank in range(2)]
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank, directory in enumerate(dirs):
            directory.mkdir()
            spec = GroupSpec(rank=rank, world_size=2, backend="gloo", timeout_s=120)
            env = {
                **os.environ,
                **spec.to_env(),
                "SHOAL_TASK_DIR": str(directory),
                "SHOAL_TASK_GENERATION": "4",
                "SHOAL_NODE_HOST": "127.0.0.1",
                "OMP_NUM_THREADS": "1",
            }
            assert "SHOAL_GROUP_PORT" not in spec.to_env()
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
                )
            )

        def relayed() -> bool:
            _relay(dirs, 4)
            published = [p["published"] for p in read_peers(dirs[1])]
            return any("rendezvous" in p for p in published)

        eventually(relayed, "rank 0 to publish its rendezvous address")
        for proc in procs:
            out, _ = proc.communicate(timeout=150)
            assert proc.returncode == 0
            assert out.strip() == "3"  # 1 + 2: both ranks were in one group
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    published = json.loads((dirs[0] / PUBLISHED).read_text())
    assert published["epoch"] == "4"
    assert published["rank"] == 0
    host, port = published["rendezvous"].rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) > 0


def test_a_rank_waits_for_its_own_epoch_and_names_it_when_none_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_TASK_DIR", str(tmp_path))
    old = {"role": "learner", "rank": 0, "epoch": "3", "rendezvous": "10.0.0.9:5"}
    write_json_atomically(
        tmp_path / PEERS,
        {"tasks": [{"id": "j-learner-0", "generation": 3, "node": "n1", "published": old}]},
        durable=False,
    )
    rendezvous = PublishedRendezvous(Publication(), "4")
    with pytest.raises(GroupError, match="epoch '4' published no rendezvous"):
        rendezvous.locate(0.2)
    new = {**old, "epoch": "4", "rendezvous": "10.0.0.2:4242", "address": "shoal://10.0.0.2:1"}
    write_json_atomically(
        tmp_path / PEERS,
        {"tasks": [{"id": "j-learner-0", "generation": 4, "node": "n2", "published": new}]},
        durable=False,
    )
    assert rendezvous.locate(5.0) == ("10.0.0.2", 4242)
    assert learner_address(0) == "shoal://10.0.0.2:1"
    assert learner_address(1) is None


def test_a_group_without_a_port_or_a_rendezvous_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs a rendezvous port"):
        LearnerGroup(GroupSpec(rank=0, world_size=2, backend="gloo"))


def test_collectives_are_bound_to_the_interface_holding_the_nodes_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "chosen-by-the-operator")
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.9") is None
    assert interface_of("not an address") is None
    bind_collectives_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "chosen-by-the-operator"


@pytest.mark.parametrize(
    ("value", "gpu"), [("3,5", 3), ("0", 0), ("", None), ("x", None), (" 7 ,1", 7)]
)
def test_a_rank_trains_on_the_first_gpu_its_placement_gave_it(value: str, gpu: int | None) -> None:
    from shoal.learner.trainer import assigned_gpu

    assert assigned_gpu({"SHOAL_TASK_GPUS": value}) == gpu


def test_a_rank_looks_again_when_its_epochs_rank_0_was_restarted_on_a_new_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node daemon back before its node was declared dead reruns rank 0 at the same epoch:
    until the new rank 0 publishes, the epoch shows the old one's address, where nothing
    answers any more. The joining rank keeps looking instead of waiting out its time-out."""
    import socket
    import threading

    monkeypatch.setenv("SHOAL_TASK_DIR", str(tmp_path))

    def show(port: int) -> None:
        state = {"role": "learner", "rank": 0, "epoch": "4", "rendezvous": f"127.0.0.1:{port}"}
        record = {"id": "j-learner-0", "generation": 4, "node": "n1", "published": state}
        write_json_atomically(tmp_path / PEERS, {"tasks": [record]}, durable=False)

    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        show(dead.getsockname()[1])  # bound, never listening: the old rank 0 is gone
    with socket.create_server(("127.0.0.1", 0)) as live:
        port = live.getsockname()[1]
        group = LearnerGroup(
            GroupSpec(rank=1, world_size=2, backend="gloo", epoch="4"),
            PublishedRendezvous(Publication(), "4"),
        )
        assert group.rendezvous is not None
        finder = threading.Thread(target=group._reach_published, args=(group.rendezvous, 60.0))
        finder.start()
        show(port)  # the restarted rank 0 publishes its new store
        finder.join(timeout=60)
        assert not finder.is_alive()
    assert group._where == f"127.0.0.1:{port}"
