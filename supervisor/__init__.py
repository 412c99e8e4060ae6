"""The supervisor daemon, one folder per stage of its loop (docs/architecture.md, its tree):

store    the database's tables and the read model every reader calls
charts   the PNG charts, drawn from the store's rollups
ingest   step records in
judge    detectors over stored steps; findings from what the trainer reports
decide   the policy: a finding in, a command out
notify   telling humans (console, Slack) through the outbox
act      action rows, sending, acknowledgements, outcomes
app      config, the Supervisor service that wires the stages, the scheduler and its jobs
serve    the HTTP app: API, web pages, auth, health, metrics
operate  the CLI's commands, clients of the HTTP API
simulate a long run's goodput under public failure rates (`thermowatch simulate`)

At this folder's root: errors, db (engines, sessions, migrations) and limits, which every stage
may import. tests/test_import_rules.py holds which stage may import which."""


def version() -> str:
    """The installed package's version (pyproject.toml); "unknown" from a bare source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("thermowatch")
    except PackageNotFoundError:
        return "unknown"
