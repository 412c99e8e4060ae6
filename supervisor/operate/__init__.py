"""The on-call's commands (`thermowatch rollback|status|incidents|export|...`): clients of the
daemon's HTTP API with an address and a token, never the database. May import the root modules
and act.outcome (the one shape an action's outcome prints in)."""
