"""Thermometers (hooks that measure) and detectors (pure code that judges series).

Depends on torch only; `thermowatch.monitors.contract` does not even need torch.
"""
