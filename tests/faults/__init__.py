"""The fault matrix (issue 13 item 6): each fault, the test that causes it for real, and what it
asserts survives. All run in CI (README's test command).

| fault | test | survives |
|---|---|---|
| a node lost (its raylet and every process on it SIGKILLed) | tests/faults/test_multinode.py | gang restarted on the remaining nodes from the newest checkpoint with its ledger; every step once |
| the controller killed (its process SIGKILLed) and the driver lost | tests/faults/test_multinode.py | Ray restarts the detached controller; new attempt of the same run; every step once |
| a gang the cluster cannot place | tests/faults/test_multinode.py | counted as failed restarts; the run ends saying what to add |
| a checkpoint write that fails (tmpfs full; then read-only) | tests/faults/test_checkpoint_faults.py | the run trains through; paged once, told when saves work; steps once |
| PostgreSQL restarted during ingest (a private cluster) | tests/faults/test_postgres_restart.py | daemon up (503 while down); sink spools and replays; steps once; judged |
| NaN injected into one layer's output | tests/faults/test_nan_injection.py | findings locate the layer; auto rollback + skip; finite again; steps once |
| a worker (rank) killed | tests/trainer/test_controller.py::test_killed_worker_restarts_gang_from_last_checkpoint | gang restarted from the last checkpoint |
| a stalled rank | tests/trainer/test_controller.py::test_stalled_rank_times_out_and_the_gang_restarts | time-out, gang restarted |
| a corrupt checkpoint | tests/trainer/test_controller.py::test_corrupt_checkpoint_is_passed_over, tests/trainer/test_checkpoint.py | passed over for an older valid one |
| the supervisor SIGKILLed mid-stream | tests/supervisor/seams/test_restart.py, tests/supervisor/judge/test_judge.py | pending command delivered, incident open, detector state kept; no finding lost or judged twice |
| Slack answering 429 and 500 | tests/supervisor/notify/test_outbox.py | ingest never blocked; every alert delivered, in order, one thread |
| non-finite values from real training (LR x1e20) | tests/supervisor/seams/test_nonfinite.py | stored as NaN; rolled back at once |

Every test counts the stored steps, and every action's final state is asserted where one is taken.
"""
