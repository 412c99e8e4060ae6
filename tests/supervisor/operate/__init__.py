"""Tests of supervisor/operate/ (docs/architecture.md's tree)."""
