"""Tests of supervisor/serve/ (docs/architecture.md's tree)."""
