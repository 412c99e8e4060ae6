"""What to do about each signal: the "what to do" column of docs/operations.md's signal table,
carried by every alert of that signal (issue 37: alerts linked no runbook; Marin keeps one per
alert). tests/supervisor/notify/test_runbook.py holds this table and the docs' to the same words."""

from __future__ import annotations

WHAT_TO_DO: dict[str, str] = {
    'attn_logit_growth': (
        "nothing if the policy rolled back; if it only alerted, watch the layer on the run's page; "
        'consider qk-LayerNorm or a lower LR for the next run'
    ),
    'attn_logit_ceiling': 'as growth; a run with healthy logits above 100 needs a higher ceiling, not silence',
    'loss_spike': 'nothing; if it comes back within `recurrence_window_steps` the policy lowers the LR too',
    'lr_jump': (
        'find who raised it (an edit, a resume with another config); the weights trained at the high '
        'LR are not undone: roll back to a checkpoint before the raise by hand if the loss does not '
        'come back (`thermowatch rollback RUN --to-step N`)'
    ),
    'loss_grad_rise': (
        'nothing; if the re-trained path rises again the policy lowers the LR too. A trainer that '
        'sends no `grad_norm` gets nothing from it'
    ),
    'loss_behind_peers': (
        "compare the run's config with the peer named in the evidence; lower the LR (`thermowatch lr "
        'RUN --factor 0.5`) if the LR is the difference. Runs without a `model` section (the '
        "client's, for now) are never compared"
    ),
    'loss_degradation': (
        'look at the LR and the data; lower the LR by hand (`thermowatch lr RUN --factor 0.5`), or '
        'add the signal to `rollback_signals`'
    ),
    'grad_spike': 'nothing unless a loss or attention signal follows; many in a row point at data',
    'non_finite': (
        'nothing if rolled back; a second one soon after means the LR or a bad node: see '
        '`outlier_rank`'
    ),
    'act_overflow': 'look at the layer; it becomes `non_finite` if it matters',
    'stall': (
        "a hung collective or a dead node: check the Ray dashboard and the node; the controller's "
        '`step_timeout_s` restarts the gang'
    ),
    'outlier_rank': (
        'drain that node (`kubectl cordon`, or terminate the instance); the message names the rank '
        'and node'
    ),
    'state_mismatch': (
        'the run is not doing what the audit trail says: compare `thermowatch actions RUN` with the '
        "trainer's log; pause it if unsure"
    ),
    'checkpoint_failed': (
        'every step since the last good checkpoint is at risk: free or grow the checkpoint volume '
        '(`df` on it; retention is `checkpoint.keep_last`/`keep_every` plus every checkpoint of the '
        'last 110 steps, older ones thinning with their age: monitors/retention.py), or check its '
        "mount; the trainer's log names the error. The next save is tried at the next interval, "
        'nothing to restart'
    ),
}



def what_to_do(signal: str) -> str | None:
    """The runbook line for `signal` (a Signal's value); None for one the table does not name."""
    return WHAT_TO_DO.get(signal)


def runbook_link(base_url: str, signal: str) -> str:
    """`base_url` (the team's copy of docs/operations.md) with the signal's anchor."""
    return f"{base_url.rstrip('#')}#{signal}"
