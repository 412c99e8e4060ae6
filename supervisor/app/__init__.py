"""The daemon's composition: its config, the Supervisor service that wires ingest, judging, deciding,
acting and telling together, the scheduler and its periodic jobs. May import every stage below
serve."""
