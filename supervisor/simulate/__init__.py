"""`thermowatch simulate`: goodput of a long run at scale under public failure rates (issue 13.8).

config.py   the assumptions, each default with its source (SimConfig)
engine.py   one run as a discrete-event simulation (run_once), deterministic in its seed
compare.py  the strategies side by side and the checkpoint-interval recommendation
report.py   the table and the JSON
"""
