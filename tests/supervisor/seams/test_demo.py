"""`thermowatch demo` end to end, as a newcomer runs it: the real CLI in a subprocess, real Ray
actors, real DeepSpeed ZeRO-2 on gloo, a learning rate that really diverges, the embedded
supervisor on the real PostgreSQL. Asserts on the JSON summary.

CI's recipe is shorter (`--steps 130`) and trains fp32 (`--dtype float32`): on a CPU without
AVX-512 (one of the two machines CI gets) bf16 matmuls are emulated, and this test alone took
9-12 minutes there in bf16 (536 s with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on an
AVX-512 EPYC, 725 s on the machine itself), against ~1 minute in fp32. The bf16 path is the
same code with another dtype: tests/trainer/test_engine.py rolls ZeRO 1-3 back bit-exact in bf16."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.supervisor.conftest import new_pg_schema, pg_schema_url

# A hang guard, not a speed goal: --compare trains the run twice.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _demo(tmp_path, *extra: str) -> dict:
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "thermowatch.cli", "demo", "--data-dir", str(tmp_path / "data"),
           "--json-summary", str(out), "--no-progress", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1700,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "incidents (" in proc.stdout and "final loss" in proc.stdout
    return json.loads(out.read_text())


# CI's shorter recipe (the demo's own `--steps`, "shorten the run (CI)"): 130 of the demo's 200
# steps, in fp32. In bf16 the run diverges by step ~53-90, is rolled back, diverges again and has
# its LR lowered well inside 130 steps; in fp32 its logits cross the ceiling earlier, inside the
# LR warm-up (step 46 on an AVX-512 AMD EPYC, 50 with AVX2 kernels), so the forecast lowers the
# LR in place at the crossing: final loss 2.58 against 2.65 unsupervised, 45 s for both runs. _check_repaired takes either
# story. The newcomer's `thermowatch demo` keeps 200 steps in bf16.
CI_STEPS = 130


def _check_repaired(summary: dict, steps: int = CI_STEPS) -> None:
    assert summary["final_step"] == steps  # the run reached its last step
    # The divergence was seen by an attention thermometer, with an onset before the detection.
    assert summary["incidents"], "no incident: the divergence went unnoticed"
    # The supervisor acted on its own: a rollback, acknowledged by the trainer at a step after
    # the checkpoint it went back to, which lies before the onset of the incident it answered
    # (earlier incidents may be alert-only: logit growth with no witness of harm yet).
    auto = [a for a in summary["actions"] if a["origin"] == "auto"]
    assert auto, summary["actions"]
    if auto[0]["kind"] == "set_lr":
        # Where the logits cross the demo's ceiling by step 50 (2x the LR still to come in its
        # 100-step warm-up; numerics differ between CPUs and dtypes), the LR forecast acts at the
        # crossing and lowers the LR in place (issue 8): nothing to roll back yet.
        # The forecast acts while the schedule still raises the LR >= lr_rise (2) fold: through
        # step 50 of the 100-step warm-up, where LR x2 is still ahead.
        (acted,) = [i for i in summary["incidents"] if i["id"] == auto[0]["incident_id"]]
        assert acted["signal"] == "attn_logit_ceiling" and acted["detect_step"] <= 50
        assert auto[0]["state"] == "done" and 0 < auto[0]["args"]["lr_multiplier"] < 1
        assert math.isfinite(summary["final_loss"])
        return
    assert len(summary["attempts"]) >= 2  # through at least one rollback (a new attempt)
    rollbacks = [a for a in auto if a["kind"] == "rollback"]
    assert rollbacks, summary["actions"]
    r = rollbacks[0]
    (acted,) = [i for i in summary["incidents"] if i["id"] == r["incident_id"]]
    assert acted["signal"].startswith("attn_logit")
    assert acted["module"].startswith("blocks.") and acted["module"].endswith(".attn")
    assert 0 < acted["onset_step"] <= acted["detect_step"]
    assert r["state"] == "done"
    assert r["args"]["to_step"] < acted["onset_step"] <= acted["detect_step"]
    assert r["ack_step"] == r["args"]["to_step"] + 1
    # The offending samples were skipped, and the skip ledger holds exactly the ranges the
    # rollbacks asked for.
    asked = sorted(tuple(x) for a in rollbacks for x in a["args"].get("skip_ranges", []))
    assert asked and all(lo < hi for lo, hi in asked)
    merged = [tuple(x) for x in summary["skipped_sample_ranges"]]
    covered = lambda lo, hi: any(mlo <= lo and hi <= mhi for mlo, mhi in merged)  # noqa: E731
    assert all(covered(lo, hi) for lo, hi in asked)
    # It came back (the LR's fault, not the data's): the ladder's second rung lowered the LR.
    assert any(a["args"].get("lr_multiplier") for a in rollbacks), "the LR was never lowered"
    assert math.isfinite(summary["final_loss"])


def test_demo_repairs_a_real_divergence_and_beats_the_unsupervised_run(tmp_path, pg_admin):
    """One demo, on PostgreSQL (the SQLite path of the same recipe runs in test_launch's
    embedded-supervisor test, and in every newcomer's `thermowatch demo`), with --compare."""
    summary = _demo(tmp_path, "--compare", "--steps", str(CI_STEPS), "--dtype", "float32",
                    "--db", pg_schema_url(new_pg_schema(pg_admin)))
    _check_repaired(summary)
    # Same run, same data, no supervisor: it ends worse (its logits end in the hundreds).
    assert summary["final_loss"] < summary["unsupervised_final_loss"]
