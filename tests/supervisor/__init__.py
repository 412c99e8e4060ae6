"""The supervisor's tests: one folder per stage of supervisor/ (store/, charts/, ..., operate/,
simulate/), seams/ for tests across stages; the helpers and conftest.py here serve them all."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository, however deep the test that reads it
