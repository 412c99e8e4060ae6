"""The web page: server-rendered HTML (pages.py: the runs list and the PNG route; run_page.py: the
run page) whose charts are drawn in the browser by one plain script (static/run.js) with the
vendored uPlot, from the JSON API (api/chart.py, api/events.py). No build step, no framework, no
CDN (assets.py). matplotlib PNGs (plots.py, the only module that imports matplotlib) stay for the
no-script fallback, Slack and `thermowatch plot`.
"""
