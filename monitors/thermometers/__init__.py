"""Thermometers: per-module activation max/min, attention logits, gradient norms, z.

    from thermowatch.monitors.thermometers import instrument
    with instrument(model) as th:
        th.begin_step(step); ...; th.end_step(loss=loss, lr=lr); values = th.collect()

See core.py for the step protocol and its cost, config.py for what is measured, budget.py for
the cost budget that sets how often.
"""

from thermowatch.monitors.thermometers.attention import AttnProbe, mha_scores_max
from thermowatch.monitors.thermometers.config import BLOCK_PATTERN, ThermometerConfig
from thermowatch.monitors.thermometers.core import Thermometers, instrument

__all__ = ["AttnProbe", "BLOCK_PATTERN", "ThermometerConfig", "Thermometers", "instrument", "mha_scores_max"]
