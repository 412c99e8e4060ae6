"""The supervisor daemon: DB, ingest, policy, actions, scheduler jobs, Slack, web, API, CLI."""


def version() -> str:
    """The installed package's version (pyproject.toml); "unknown" from a bare source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("thermowatch")
    except PackageNotFoundError:
        return "unknown"
