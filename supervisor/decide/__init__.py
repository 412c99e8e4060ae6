"""Deciding: the pure policy (a finding in, a command out, with its reason), its replay twin, the
feasibility checks of a command against its run, and who may approve one. May import: store and
the root modules."""
