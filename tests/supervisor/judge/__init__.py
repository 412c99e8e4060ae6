"""Tests of supervisor/judge/ (docs/architecture.md's tree)."""
