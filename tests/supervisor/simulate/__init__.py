"""Tests of supervisor/simulate/ (docs/architecture.md's tree)."""
