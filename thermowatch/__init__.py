"""thermowatch: a divergence watchdog for any training loop, and the supervisor daemon behind it.

The public API is what this module exports (docs/any-trainer.md). The supervisor daemon, the
bundled trainer, the thermometers and detectors, and the database migrations live under it as
`thermowatch.supervisor`, `thermowatch.trainer`, `thermowatch.monitors` and
`thermowatch.migrations`: an installed wheel adds no other top-level name to site-packages.
"""

from __future__ import annotations

from pathlib import Path as _Path

# In a source checkout the four packages are folders beside this one (the repository keeps its
# top-level layout; pyproject.toml's package-dir maps them under `thermowatch.` in the wheel).
# An installed wheel has them inside this folder and nothing to add here.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "supervisor" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
del _Path, _checkout

# The public names, imported on first use: `import thermowatch` costs nothing until one is used,
# and `thermowatch.supervisor` (the daemon) never pulls in torch through here.
_PUBLIC = {
    "watch": "thermowatch.loop", "Watch": "thermowatch.loop", "WatchConfig": "thermowatch.watch_config",
    "Run": "thermowatch.run",
    "ThermometerConfig": "thermowatch.monitors.thermometers", "instrument": "thermowatch.monitors.thermometers",
    "StepRecord": "thermowatch.monitors.contract", "Ack": "thermowatch.monitors.contract",
    "Command": "thermowatch.monitors.contract", "Rollback": "thermowatch.monitors.contract",
    "Skip": "thermowatch.monitors.contract", "SetLR": "thermowatch.monitors.contract",
    "Pause": "thermowatch.monitors.contract", "Resume": "thermowatch.monitors.contract",
    "Stop": "thermowatch.monitors.contract", "SampleRange": "thermowatch.monitors.contract",
    "LRChange": "thermowatch.monitors.contract", "Bisected": "thermowatch.monitors.contract",
    "PreciseSkip": "thermowatch.precise_skip",
    "PauseNotice": "thermowatch.paused",  # a Run loop's own pause prints the lines watch() prints
}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    # The public names are imported on first use, so they are not in this module's namespace
    # until then: dir(thermowatch) listed none of them (issue 35).
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'thermowatch' has no attribute {name!r}")
