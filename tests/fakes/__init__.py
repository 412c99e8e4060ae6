"""Hand-written fakes for what lives outside the machine (STYLE.md 12): only the Slack API."""
