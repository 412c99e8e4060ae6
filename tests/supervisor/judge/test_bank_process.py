"""The detectors in a process of their own (supervisor.judge.bank_process), with records from a real
diverging run: a bank in the child judges exactly as one in the daemon's process; the daemon
finds what the embedded mode finds; a child killed mid-run loses no finding and judges nothing
twice (a new child takes over from the saved state); a SIGKILLed daemon leaves no child behind.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import RunInfo
from thermowatch.monitors.detectors import BankConfig, DetectorBank
from thermowatch.supervisor.judge.bank_process import BankLost, BankProcess
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import judged as judged_store
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, uninterrupted
from tests.supervisor import ROOT

RUN = "bp"


def make_sup(url: str, data_dir, judge_process: bool = True, **kw) -> Supervisor:
    cfg = SupervisorConfig(data_dir=data_dir, db_url=url, policy=dict(POLICY), detectors=dict(DETECTORS),
                           judge_process=judge_process)
    return Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), **kw)


def batches(size: int = 10):
    recs = diverging_records()
    return [recs[i:i + size] for i in range(0, len(recs), size)]


def findings(sup):
    with sup.sessions() as s:
        return sorted((f.finding.signal.value, f.finding.module, f.finding.metric, f.finding.detect_step,
                       f.finding.outcome.value) for f in findings_store.findings(s, RUN))


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What the embedded mode (detectors in its own process, judged inline) finds in the run."""
    d = tmp_path_factory.mktemp("ref")
    sup = make_sup(f"sqlite:///{d / 'ref.db'}", d / "data")
    assert sup.bank_process is None  # inline: the detectors stay in the caller's process
    found = uninterrupted(sup, RUN, batches(), findings)
    assert any(f[4] == "act" for f in found), "the diverging run raised no finding to act on"
    return found


def test_a_bank_in_the_child_judges_as_one_in_this_process():
    """Same stream (records, columns, single records, a rewind), same findings, same saved bytes."""
    cfg = BankConfig.from_dict(DETECTORS)
    host = BankProcess(cfg)
    try:
        local, remote = DetectorBank(cfg), host.bank(RUN)
        assert host.pid != os.getpid() and host.alive
        recs = diverging_records()
        steps = []
        for i, b in enumerate(batches(7)):
            batch = StepColumns.from_records(b) if i % 2 else b
            want, got = local.observe_many(batch, 0), remote.observe_many(batch, 0)
            assert got == want
            steps.append(len(want))
            if i == 5:  # a delta save in the middle: the same dirty parts, then both marked saved
                assert remote.state_parts(dirty_only=True) == local.state_parts(dirty_only=True)
                local.mark_saved()
                remote.mark_saved()
        assert sum(steps) > 0, "the run raised no finding: the comparison proves little"
        assert remote.state_parts(dirty_only=True) == local.state_parts(dirty_only=True)
        assert remote.state_parts() == local.state_parts()
        # A rollback, then the same steps again one record at a time, then the wall clock.
        local.reset(40)
        remote.reset(40)
        for r in recs[39:60]:
            assert remote.observe(r, 1) == local.observe(r, 1)
        now = recs[59].wall_time + 3600
        assert remote.check(now) == local.check(now)
        assert remote.state_parts() == local.state_parts()
        # A bank loaded from saved parts in the child is the bank that saved them.
        again = host.bank("other")
        again.load_state_parts(local.state_parts())
        assert again.state_parts() == local.state_parts()
        # An error in the child is raised here, with its type (the responder's fallback for an
        # older saved state depends on the ValueError).
        with pytest.raises(ValueError, match="detector state version"):
            again.load_state_parts({"meta": b'{"version": 1}'})
        # SIGINT (a Ctrl-C reaches the whole process group) and SIGTERM (systemd stops the whole
        # cgroup) leave the child serving, so the daemon's close() can still save every bank.
        os.kill(host.pid, signal.SIGINT)
        os.kill(host.pid, signal.SIGTERM)
        time.sleep(0.2)
        assert remote.state_parts() == local.state_parts()
        assert host.restarts == 0
    finally:
        host.close()
    assert not host.alive
    with pytest.raises(BankLost):
        host.bank(RUN)


def test_released_latches_fire_again_on_what_persists_in_the_child_as_here():
    """DetectorBank.release_latches (a step cooldown that held a finding back has ended, issue 22):
    a latched detector stays silent on a divergence that goes on; released, it fires again on
    the next point, and nothing judged is forgotten. The same through the detectors' process."""
    cfg = BankConfig.from_dict(DETECTORS)
    host = BankProcess(cfg)
    try:
        local, remote = DetectorBank(cfg), host.bank(RUN)
        recs = diverging_records()

        def ceiling(found):
            return sorted((f.module, f.detect_step) for f in found if f.signal.value == "attn_logit_ceiling")

        first = [m for r in recs[:70] for m in ceiling(local.observe(r, 0))]
        assert [m for r in recs[:70] for m in ceiling(remote.observe(r, 0))] == first
        modules = [m for m, _ in first]
        assert first, "the run crossed no ceiling: the test proves nothing"
        later = ceiling(local.observe_many(recs[70:75], 0))
        assert later == ceiling(remote.observe_many(recs[70:75], 0))
        assert not {m for m, _ in later} & set(modules), later  # still above, still silent
        local.release_latches()
        remote.release_latches()
        again = ceiling(local.observe(recs[75], 0))
        assert again == ceiling(remote.observe(recs[75], 0))
        assert {m for m, _ in again} & set(modules) and {s for _, s in again} == {recs[75].step}, again
        assert remote.state_parts() == local.state_parts()
    finally:
        host.close()


def test_the_daemon_judges_in_the_child_and_finds_what_the_embedded_mode_finds(db, tmp_path, reference):
    sup = make_sup(db.url, tmp_path / "a", judge_inline=False)
    try:
        sup.open_run(RunInfo(RUN, 0, world_size=1))
        for b in batches():
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        assert sup.bank_process is not None and sup.bank_process.alive
        assert sup.bank_process.pid != os.getpid()
        assert findings(sup) == reference
    finally:
        sup.close()
    assert not running(sup.bank_process.pid), "close() left the detectors' process running"


def test_judge_process_false_keeps_the_detectors_in_the_daemon(db, tmp_path, reference):
    sup = make_sup(db.url, tmp_path / "c", judge_process=False, judge_inline=False)
    try:
        assert sup.bank_process is None
        sup.open_run(RunInfo(RUN, 0, world_size=1))
        for b in batches():
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        assert findings(sup) == reference
    finally:
        sup.close()


def test_a_killed_detectors_process_loses_no_finding_and_judges_nothing_twice(db, tmp_path, reference):
    bs = batches()
    cut = next(i for i, b in enumerate(bs) if any(f[3] <= b[-1].step for f in reference if f[4] == "act")) - 1
    assert cut > 2, "the run acts too early for a kill before it"
    sup = make_sup(db.url, tmp_path / "b", judge_inline=False)
    try:
        sup.open_run(RunInfo(RUN, 0, world_size=1))
        for b in bs[:cut]:
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        sup.banks.save_states()  # as every 5 s; the kill loses what came after a save
        first = sup.bank_process.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The next batch finds the child dead: that judgement fails, the judge catches up from its
        # marker, and the responder reloads the bank from its saved state into a new child.
        for b in bs[cut:]:
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        assert sup.bank_process.restarts == 1
        assert sup.bank_process.pid != first and sup.bank_process.alive
        assert findings(sup) == reference  # every finding, each once
        with sup.sessions() as s:
            assert judged_store.through(s, RUN, 0) == bs[-1][-1].step
    finally:
        sup.close()


_DAEMON = """
import io, sys, time
from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from tests.fixtures.diverging import diverging_records
sup = Supervisor(SupervisorConfig(data_dir=sys.argv[1], db_url=sys.argv[2]), notifier=ConsoleNotifier(io.StringIO()),
                 judge_inline=False)
sup.open_run(RunInfo("k", 0, world_size=1))
sup.write("k", 0, diverging_records()[:20])
assert sup.judge.wait(60)
print(sup.bank_process.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_daemon_leaves_no_detectors_process(tmp_path):
    diverging_records()  # trained and cached on disk before the child process reads it
    proc = subprocess.Popen([sys.executable, "-c", _DAEMON, str(tmp_path), f"sqlite:///{tmp_path / 'k.db'}"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child = int(proc.stdout.readline())
        assert running(child)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the detectors' process outlived its SIGKILLed daemon"
    finally:
        proc.kill()
        proc.wait(10)
