"""Charts drawn from the store's rollups: the PNG renderer (plots) and the one read path the
web page's PNG route and Slack's incident chart share (png). May import: store and the root
modules (errors, db, limits)."""
