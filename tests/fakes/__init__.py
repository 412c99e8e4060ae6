"""Hand-written fakes for what lives outside the machine (STYLE.md 12): the Slack API
(slack_server.py), PagerDuty and webhook receivers (pager_server.py), a mail server
(smtp_server.py), and the network between a trainer and the daemon (network.py: late, lost or
never-answered replies from a real daemon). served.py is the start/stop lifecycle the three
servers share."""
