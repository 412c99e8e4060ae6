"""Tests of supervisor/act/ (docs/architecture.md's tree)."""
