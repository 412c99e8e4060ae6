"""Each alert says what to do about its signal (issue 37 item 5: no alert linked a runbook). The
words are docs/operations.md's signal table's "what to do" column, held to them here, so the docs
and the alerts never drift; with `runbook_url` the alert links the signal's row too."""

from __future__ import annotations

import io

import pytest

from thermowatch.monitors.contract import Finding, RunInfo, Severity, Signal
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.decide.policy import Decision
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.runbook import WHAT_TO_DO
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.supervisor import ROOT

DOC = ROOT / "docs" / "operations.md"


def _docs_table() -> dict[str, str]:
    lines = DOC.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("| signal | what it saw | default | what to do |"))
    rows = {}
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0].strip("`")] = cells[3]
    return rows


def test_the_alerts_runbook_is_the_docs_table_word_for_word():
    assert WHAT_TO_DO == _docs_table()
    missing = {s.value for s in Signal} - set(WHAT_TO_DO)
    assert not missing, f"signals without a runbook line in docs/operations.md: {sorted(missing)}"


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_an_alert_carries_what_to_do_and_links_the_row(db, tmp_path):
    cfg = SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url, runbook_url="https://wiki.example/ops.md")
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    try:
        sup.open_run(RunInfo(run_id="r", attempt=0, world_size=1))
        f = Finding(Signal.LOSS_SPIKE, "", Severity.CRITICAL, 10, 12, metric="loss")
        with sup.sessions.begin() as s:
            inc = incidents_store.open_incident(s, "r", f.signal.value, "", 10, 12, "critical")
            sup.executor.carry_out(s, "r", inc, f, Decision(None, ["loss_spike on loss"]))
        with sup.sessions() as s:
            (row, *_) = [a for a in alerts_store.alerts(s, "r") if a.payload and not a.payload.get("chart")]
        fields = row.payload["fields"]
        assert fields["what to do"] == WHAT_TO_DO["loss_spike"]
        assert fields["runbook"] == "https://wiki.example/ops.md#loss_spike"
    finally:
        sup.close()
