"""Judging: the detectors over newly stored steps, off the request path (judge, bank_process),
and the checks that raise findings from what the trainer reports (consistency, checkpoint_health).
May import: notify, store and the root modules."""
