"""Process, GPU, clock and disk faults on real processes and real files."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shoal.chaos.errors import FaultError
from shoal.chaos.faults import (
    ClockSkew,
    DiskFull,
    GpuXid,
    KillProcess,
    OffsetClock,
    PauseProcess,
    WriterFileLimit,
    XidStorm,
)
from shoal.learner.checkpoint import CheckpointManager
from shoal.local import LocalCluster, ProcessSpec, coordinator_specs, node_specs
from shoal.scheduler.health.clock import CHAOS_CLOCK_ENV, measure, serve_clock
from shoal.scheduler.health.simgpu import SimGpuBackend, gpu_collector
from tests.support.waiting import eventually, eventually_async

pytestmark = pytest.mark.timeout(60)

RUN_TIME_LIMIT_S = 600
"""A training child's own --time-limit: longer than any test here may run, so the test stops
the run (SIGTERM, `stopped_by` interrupted), never the run's clock, which a loaded machine
reaches first; it only bounds a child a dead test harness left behind."""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[LocalCluster]:
    """A local cluster whose one process is a sleeping Python child naming the run dir."""
    cluster = LocalCluster(tmp_path / "run")
    argv = [sys.executable, "-c", "import time; time.sleep(600)", str(tmp_path / "run")]
    cluster.create([ProcessSpec("s1", argv, "sleeper")])
    try:
        cluster.start("s1")
        yield cluster
    finally:
        cluster.stop_all()


def test_kill_and_restart(sleeper: LocalCluster) -> None:
    fault = KillProcess(sleeper, "s1")
    first = sleeper.pid("s1")
    assert f"pid {first}" in fault.inject()
    assert sleeper.pid("s1") is None
    assert "restarted" in fault.heal()
    assert sleeper.pid("s1") not in (None, first)
    assert "already running" in fault.heal()


def test_pause_and_resume(sleeper: LocalCluster) -> None:
    fault = PauseProcess(sleeper, "s1")
    fault.inject()
    pid = sleeper.pid("s1")
    assert pid is not None
    eventually(lambda: _state(pid) == "T", "the process is stopped")
    fault.heal()
    eventually(lambda: _state(pid) != "T", "the process runs again")


def test_faulting_a_process_that_is_not_running(sleeper: LocalCluster) -> None:
    sleeper.kill("s1")
    with pytest.raises(FaultError, match="s1 is not running"):
        KillProcess(sleeper, "s1").inject()
    with pytest.raises(FaultError, match="no process 'zz'"):
        PauseProcess(sleeper, "zz").inject()


def test_gpu_xid_reaches_the_nvml_collector(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    collector = gpu_collector(sim_gpus=4, state_file=state)
    try:
        # The watcher thread ignores XIDs raised before it subscribed: raise until one lands.
        seen: list[int] = []

        def landed() -> bool:
            GpuXid(state, gpu=2, xid=79).inject()
            for _ in range(20):
                time.sleep(0.05)
                seen.extend(collector.collect().gpus[2].xid_events)
            return bool(seen)

        eventually(landed, "an XID reaches the collector")
        assert set(seen) == {79}
    finally:
        collector.close()
    with pytest.raises(FaultError, match="no simulated GPU state"):
        GpuXid(tmp_path / "none.json", gpu=0).inject()
    with pytest.raises(FaultError, match="GPU fault"):
        GpuXid(state, gpu=9).inject()
    assert SimGpuBackend.attach(state).nvmlDeviceGetCount() == 4


def test_clock_skew_shows_in_the_four_timestamp_exchange(tmp_path: Path) -> None:
    offset_file = tmp_path / "offset"
    skewed = OffsetClock(offset_file, refresh=0.0)
    fault = ClockSkew(offset_file, 2.5)

    async def main() -> tuple[float, float]:
        server = await serve_clock(clock=skewed)
        try:
            fault.inject()
            during = await asyncio.to_thread(measure, "127.0.0.1", server.port)
            fault.heal()
            after = await asyncio.to_thread(measure, "127.0.0.1", server.port)
            return during.offset_s, after.offset_s
        finally:
            server.close()

    during, after = asyncio.run(main())
    assert abs(during - 2.5) < 0.5
    assert abs(after) < 0.5


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_on_a_real_tmpfs(tmp_path: Path) -> None:
    fault = DiskFull(tmp_path / "ckpt", size=1 << 20)
    try:
        fault.inject()
        with pytest.raises(OSError) as info:
            (tmp_path / "ckpt" / "step-1.pt").write_bytes(b"x" * 4096)
        assert info.value.errno == errno.ENOSPC
        fault.heal()
        (tmp_path / "ckpt" / "step-1.pt").write_bytes(b"x" * 4096)
    finally:
        fault.close()
    assert not (tmp_path / "ckpt" / "step-1.pt").exists()


def test_writer_file_limit_fails_the_writer(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        f"f = open({str(tmp_path / 'big')!r}, 'wb', buffering=0)\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        f.write(b'x' * 4096)\n"
        "    print('wrote')\n"
        "except OSError as exc:\n"
        "    print('errno', exc.errno)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        assert proc.stdout.readline() == "ready\n"
        fault = WriterFileLimit(proc.pid, 1000)
        fault.inject()
        assert resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)[0] == 1000
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.stdout.read()
        fault.heal()
        assert out.strip() == f"errno {errno.EFBIG}"
        assert (tmp_path / "big").stat().st_size <= 1000
    finally:
        proc.kill()
        proc.wait()


def test_writer_file_limit_refuses_a_writer_that_sigxfsz_would_kill() -> None:
    """`sleep` keeps SIGXFSZ's default action (core dump): limiting it would kill, not fail."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(FaultError, match="neither ignores nor handles SIGXFSZ"):
            WriterFileLimit(proc.pid, 10).inject()
        assert resource.prlimit(proc.pid, resource.RLIMIT_FSIZE) == resource.getrlimit(
            resource.RLIMIT_FSIZE
        )
    finally:
        proc.kill()
        proc.wait()


def test_writer_file_limit_on_a_gone_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(FaultError, match="cannot limit"):
        WriterFileLimit(proc.pid, 10).inject()


def test_xid_storm_raises_until_stopped(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    SimGpuBackend(2, state_file=state)

    async def main() -> tuple[str, int]:
        storm = XidStorm(GpuXid(state, gpu=1, xid=48), period=0.01)
        await storm.start()
        await asyncio.sleep(0.5)
        return await storm.stop(), storm.raised

    line, raised = asyncio.run(main())
    xids = json.loads(state.read_text())["xids"]
    assert raised >= 2
    assert len(xids) == raised
    assert {(x["gpu"], x["xid"]) for x in xids} == {(1, 48)}
    assert f"{raised} XIDs raised" in line


def test_a_storm_stopped_at_any_moment_counts_every_xid_it_wrote(tmp_path: Path) -> None:
    """A stop may land while a write is in flight or just after it finished; either way the
    count matches the state file (a stop between the write and its count once lost one)."""

    async def storm_for(state: Path, seconds: float) -> int:
        storm = XidStorm(GpuXid(state, gpu=0, xid=79), period=0.0)
        await storm.start()
        await asyncio.sleep(seconds)
        await storm.stop()
        return storm.raised

    for i in range(150):
        state = tmp_path / f"gpus-{i}.json"
        SimGpuBackend(1, state_file=state)
        raised = asyncio.run(storm_for(state, i / 10_000))
        assert len(json.loads(state.read_text())["xids"]) == raised, i


def _replicated_offset_ms(cluster: LocalCluster) -> float | None:
    """n1's clock offset as the coordinator replicated it (None until it has one)."""
    try:
        node = cluster.get(f"{cluster.api_urls()[0]}/v1/nodes/n1")
    except OSError:
        return None
    summary = (node.get("health") or {}).get("summary") or {}
    offset = summary.get("clock_offset_ms")
    return None if offset is None or "clock" in node["health"].get("unavailable", {}) else offset


async def _offset_until(cluster: LocalCluster, near_ms: float) -> float:
    seen: list[float | None] = [None]

    async def near() -> tuple[float] | None:
        seen[0] = offset = await asyncio.to_thread(_replicated_offset_ms, cluster)
        return None if offset is None or abs(offset - near_ms) >= 250.0 else (offset,)

    (offset,) = await eventually_async(
        near,
        f"n1's replicated clock offset near {near_ms} ms",
        detail=lambda: f"it stayed {seen[0]} ms",
    )
    return offset


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_clock_skew_on_a_real_node_daemon_shows_in_its_replicated_health(tmp_path: Path) -> None:
    """A node daemon started with the chaos clock hook, measuring against a real responder: its
    clock 2.5 s ahead makes the coordinator's record of it show -2.5 s (responder minus node),
    and healing brings it back to about 0."""
    cluster = LocalCluster(tmp_path / "run")
    offset_file = tmp_path / "n1-clock-offset"
    fault = ClockSkew(offset_file, 2.5, target="n1")

    async def main() -> tuple[float, float, float]:
        responder = await serve_clock()
        try:
            coordinators = coordinator_specs(cluster.run_dir, 1)
            extra = ("--clock", f"127.0.0.1:{responder.port}", "--heartbeat", "0.3",
                     "--health-period", "0.3")  # fmt: skip
            (node,) = node_specs(
                cluster.run_dir, [s.api_url or "" for s in coordinators], 1, 0, extra_args=extra
            )
            node = ProcessSpec(
                node.name, node.argv, node.kind, env={CHAOS_CLOCK_ENV: str(offset_file)}
            )
            cluster.create([*coordinators, node])
            await asyncio.to_thread(cluster.start_all)
            await asyncio.to_thread(cluster.wait_ready)
            await asyncio.to_thread(cluster.wait_nodes, 1, 60.0)
            before = await _offset_until(cluster, 0.0)
            assert "skewed by +2.5 s" in fault.inject()
            during = await _offset_until(cluster, -2500.0)
            assert "back to true time" in fault.heal()
            after = await _offset_until(cluster, 0.0)
            return before, during, after
        finally:
            responder.close()

    try:
        before, during, after = asyncio.run(main())
    finally:
        cluster.stop_all()
    assert abs(during + 2500.0) < 250.0
    assert abs(before) < 250.0
    assert abs(after) < 250.0


class Training:
    """A real embedded training run (`shoal train cartpole`, one learner rank checkpointing
    every second) as a child process, and what it writes."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.checkpoints = CheckpointManager(run_dir / "checkpoints")
        self.proc: subprocess.Popen[str] | None = None
        self.newest: list[int] = []
        """Every newest complete checkpoint step seen, in order: must never decrease."""

    def start(self) -> None:
        argv = [
            sys.executable, "-m", "shoal", "train", "cartpole", "--json", "--quiet", "--no-eval",
            "--run-dir", str(self.run_dir), "--ranks", "1", "--workers", "1",
            "--checkpoint-interval", "1", "--seed", "3", "--target-return", "1e9",
            "--time-limit", str(RUN_TIME_LIMIT_S),
        ]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)

    def status(self) -> dict:
        try:
            return dict(json.loads((self.run_dir / "status-0.json").read_text()))
        except (OSError, ValueError):
            return {}

    def journal(self) -> Path:
        """Rank 0's accounting journal (named by the incarnation in its status)."""
        incarnation = self.status()["incarnation"]
        return self.run_dir / "accounting" / f"learner-0-{incarnation}.jsonl"

    def learner_starts(self) -> int:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        return sum(e["event"] == "start" and e.get("process") == "learner" for e in events)

    def newest_step(self) -> int:
        info = self.checkpoints.latest()
        step = -1 if info is None else info.step
        self.newest.append(step)
        return step

    def until(self, what: str, check: Callable[[], bool], within: float = 60.0) -> None:
        def ready() -> bool:
            self.newest_step()
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"training exited ({self.proc.returncode}) before: {what}")
            return check()

        eventually(ready, what, timeout=within, detail=lambda: f"status {self.status()}")

    def stop(self) -> dict:
        """SIGTERM (an orderly stop: final checkpoint); the run's JSON summary."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return dict(json.loads(out.strip().splitlines()[-1]))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        self.checkpoints.close()


def _disk_full_of(kind: str, run_dir: Path) -> DiskFull | WriterFileLimit:
    if kind == "tmpfs":
        fault = DiskFull(run_dir / "checkpoints", size=1 << 20, target="checkpoints")
        fault.mount()  # before the learner starts: it checkpoints into the tmpfs from the first
        return fault
    return WriterFileLimit(0, 0)  # pid and limit are set once the learner runs


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _limit_the_journal_has_reached(training: Training) -> int:
    """The rank's file size limit, read from its files just before injecting: the size its
    accounting journal has reached. A write that starts at or past RLIMIT_FSIZE fails (EFBIG)
    and the journal only grows, so its next append is held however fast the machine trains
    (a fixed limit raced the journal's growth). Waiting until the journal is twice the status
    file keeps the files the rank rewrites whole (status, ledger snapshot) under the limit; a
    checkpoint stays at least twice over it. Appends to events.jsonl past it are skipped."""
    journal, status = training.journal(), training.run_dir / "status-0.json"
    training.until(
        "the journal outgrows the status file twice over",
        lambda: _size(journal) >= 2 * _size(status),
    )
    checkpoint = training.checkpoints.latest()
    assert checkpoint is not None
    return min(_size(journal), checkpoint.size // 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind",
    [
        "rlimit",
        pytest.param(
            "tmpfs",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
        ),
    ],
)
def test_disk_full_under_a_real_learner_rank(tmp_path: Path, kind: str) -> None:
    """Checkpoint writes of a training learner fail (ENOSPC on a full tmpfs, or EFBIG past
    its file size limit): the failures are counted in its status, it keeps training, and
    after healing a newer complete checkpoint appears; checkpoints only move forward."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fault = _disk_full_of(kind, run_dir)
    training = Training(run_dir)
    try:
        training.start()
        training.until(
            "a first checkpoint and status",
            lambda: training.newest_step() >= 1 and "pid" in training.status(),
        )
        if isinstance(fault, WriterFileLimit):
            fault.pid = int(training.status()["pid"])  # the rank's own word, however it runs
            fault.limit = _limit_the_journal_has_reached(training)
        fault.inject()
        training.until(
            "two failed checkpoint writes", lambda: training.status()["checkpoint_failures"] >= 2
        )
        version = training.status()["version"]
        training.until("training goes on", lambda: training.status()["version"] > version + 2)
        held = training.newest_step()
        faulted = training.status()
        assert "disk is full" in faulted["checkpoint_error"]
        if kind == "rlimit":  # versions trained since inject() appended past the limit: held
            assert faulted["journal_full_writes"] > 0
        fault.heal()
        training.until("a newer complete checkpoint", lambda: training.newest_step() > held)
        training.until(
            "the journal caught up", lambda: training.status()["journal_held_bytes"] == 0
        )
        summary = training.stop()
        final = training.newest_step()
    finally:
        training.close()
        if isinstance(fault, DiskFull):
            fault.close()
    assert summary["stopped_by"] == "interrupted"
    assert training.learner_starts() == 1, "the full disk restarted the rank"
    assert summary["checkpoint_step"] == final
    assert final > held
    assert training.newest == sorted(training.newest)
