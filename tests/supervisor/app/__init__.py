"""Tests of supervisor/app/ (docs/architecture.md's tree)."""
