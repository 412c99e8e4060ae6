"""Tests of supervisor/decide/ (docs/architecture.md's tree)."""
