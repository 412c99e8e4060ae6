"""Tests of supervisor/store/ (docs/architecture.md's tree)."""
