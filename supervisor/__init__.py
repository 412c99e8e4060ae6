"""The supervisor daemon: DB, ingest, policy, actions, scheduler jobs, Slack, web, API, CLI."""
