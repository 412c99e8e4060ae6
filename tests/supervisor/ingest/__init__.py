"""Tests of supervisor/ingest/ (docs/architecture.md's tree)."""
