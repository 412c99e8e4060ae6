"""Tests across stages: the supervisor with the trainer, the CLI, a restart or a second daemon."""
