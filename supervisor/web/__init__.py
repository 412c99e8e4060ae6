"""The web page: plain server-rendered HTML (pages.py) with thermometer charts as PNGs
(plots.py, the only module that imports matplotlib). No build step, no JavaScript framework:
the page an on-call engineer opens from the Slack link must work from any browser.
"""
