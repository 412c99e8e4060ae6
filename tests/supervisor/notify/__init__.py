"""Tests of supervisor/notify/ (docs/architecture.md's tree)."""
