"""Tests of supervisor/charts/ (docs/architecture.md's tree)."""
