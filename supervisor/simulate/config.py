"""What `thermowatch simulate` assumes: one validated dataclass, every default with its source.

A YAML file lists only what differs (`thermowatch simulate --config sim.yaml`); keys and types
are checked as one tree (monitors.config_tree), ranges here in __post_init__.

Public figures the defaults come from:

- YaLM-100B (Yandex, 2022, github.com/yandex/YaLM-100B and the accompanying Medium post):
  800 A100s for 65 days; 80 layers, d_model 10240.
- Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4): 466 job
  interruptions (47 planned, 419 unexpected) in a 54-day snapshot on 16,384 H100s.
- OPT-175B (Zhang et al. 2022, section 2.5, and the OPT logbook): 992 A100s; "105 restarts"
  over about two months, counted here as 60 days.
- PaLM (Chowdhery et al. 2022, section 5.1): "roughly 20" loss spikes over the 540B model's
  255k steps; restarting ~100 steps before a spike and skipping 200-500 batches fixed each.
- bench/divergence.py (this repository, BENCHMARKS.md "Divergence detection"): the default
  policy acted on 15/17 damaged runs, 0 false actions per 10k healthy steps; OLMo-core's
  rule (loss or grad norm > mean + 6 std of 128 steps) 14/17, 20.59 per 10k.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from thermowatch.monitors.config_tree import ConfigTreeError, check_tree
from thermowatch.supervisor.app.config import ConfigError, read_mapping

# Crashes per GPU per day, from interruption counts over a run's length and size. Hardware
# failures scale with the number of GPUs, so a rate per GPU-day carries over to 800 GPUs.
CRASH_RATES = {
    "llama3": 466 / (54 * 16_384),  # Llama 3: 466 interruptions, 54 days, 16,384 H100
    "opt175b": 105 / (60 * 992),  # OPT-175B: 105 restarts, ~2 months, 992 A100
}
PALM_SPIKES, PALM_STEPS = 20, 255_000  # PaLM 540B: ~20 loss spikes in 255k steps
# bench/divergence.py, the last grid in BENCHMARKS.md (44 runs, 17 damaged, 27 healthy).
BENCH_DEFAULTS = {
    "policy": {"false_actions_per_10k": 0.0, "miss_rate": 2 / 17, "detect_steps": 1},
    "olmo_core": {"false_actions_per_10k": 20.59, "miss_rate": 3 / 17, "detect_steps": 1},
}
BENCH_JSON = "/tmp/divbench/divergence.json"  # where `python bench/divergence.py` caches its --json line


@dataclass(frozen=True)
class DetectorFigures:
    """How an automatic detector performs, measured by bench/divergence.py (or its defaults)."""

    false_actions_per_10k: float  # actions on healthy steps, per 10k healthy steps
    miss_rate: float  # damaged runs it never acts on (a human finds those)
    detect_steps: int  # steps from the damage to the action (median; acting early counts 0)
    source: str


@dataclass
class SimConfig:
    gpus: int = 800  # YaLM-100B
    days: float = 65.0  # YaLM-100B's wall time
    # deploy/yalm-100b/train.yaml: 100B parameters, 1600 x 2048 tokens a step on 800 A100
    # (312 TFLOP/s bf16) at 40% MFU: 6 * 1e11 * 3.28e6 / (800 * 312e12 * 0.4) = 19.7 s a step.
    step_s: float = 19.7
    checkpoint_every: int = 250  # steps; deploy/yalm-100b/train.yaml's interval
    keep_last: int = 4  # retention as in deploy/yalm-100b/train.yaml: the newest K ...
    keep_every: int = 5000  # ... plus the first checkpoint of every keep_every-step span
    # 100B params with AdamW in mixed precision hold ~16 bytes a parameter (bf16 weights, fp32
    # master, two moments): 1.6 TB of ZeRO shards, ~150 s at ~10 GB/s to a parallel filesystem.
    save_s: float = 150.0
    load_s: float = 180.0  # reading the shards back (reads are a little slower: every rank at once)
    restart_s: float = 600.0  # re-placing the gang, NCCL init, data loader warm-up
    # A rollback by the supervisor reloads in the live gang (trainer/controller.py, reuse_gang):
    # the load and a little more, no re-placement. A person without it relaunches the job
    # (restart_s + load_s).
    rollback_s: float = 240.0
    crash_detect_s: float = 120.0  # automatic: Ray reports a dead actor in seconds, a hung step later
    rollback_margin_steps: int = 100  # PaLM: restart ~100 steps before the spike (PolicyConfig's default)
    crash_scenarios: tuple[str, ...] = ("llama3", "opt175b")  # names in CRASH_RATES
    crashes_per_gpu_day: float | None = None  # set to use one custom rate instead of the scenarios
    divergences_per_step: float = PALM_SPIKES / PALM_STEPS
    # A person: during the day a loss spike or a dead job is noticed after ~1 h on average; at
    # night nobody looks until the morning (no pager for a loss curve).
    human_day_hours: tuple[int, int] = (9, 21)
    human_day_latency_h: float = 1.0
    start_hour: float = 9.0  # the run starts at 09:00
    # bench/divergence.py's cached --json output; read when it exists, else BENCH_DEFAULTS.
    divergence_json: str = BENCH_JSON
    # Set any of these to override the policy's measured figures (what-if: a slower detector,
    # a noisier one); null keeps the measured one.
    detect_steps: int | None = None
    false_actions_per_10k: float | None = None
    miss_rate: float | None = None
    replicas: int = 16  # runs per row (the table shows the mean); more = smoother, slower
    sweep_points: int = 13  # checkpoint intervals tried around Young/Daly for the recommendation

    def __post_init__(self) -> None:
        self.crash_scenarios = tuple(self.crash_scenarios)
        self.human_day_hours = tuple(int(h) for h in self.human_day_hours)
        positive = ("gpus", "days", "step_s", "checkpoint_every", "keep_last", "replicas", "sweep_points")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("save_s", "load_s", "restart_s", "rollback_s", "crash_detect_s", "rollback_margin_steps", "keep_every",
                     "divergences_per_step", "human_day_latency_h"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("detect_steps", "false_actions_per_10k"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0 or null, got {getattr(self, name)!r}")
        if self.miss_rate is not None and not 0 <= self.miss_rate <= 1:
            raise ConfigError(f"miss_rate must be in [0, 1] or null, got {self.miss_rate!r}")
        if self.crashes_per_gpu_day is not None and not self.crashes_per_gpu_day >= 0:
            raise ConfigError(f"crashes_per_gpu_day must be >= 0 or null, got {self.crashes_per_gpu_day!r}")
        unknown = [s for s in self.crash_scenarios if s not in CRASH_RATES]
        if unknown:
            raise ConfigError(f"crash_scenarios: unknown {unknown}; known: {sorted(CRASH_RATES)} "
                              "(or set crashes_per_gpu_day)")
        if not self.crash_scenarios and self.crashes_per_gpu_day is None:
            raise ConfigError("crash_scenarios is empty: name one of "
                              f"{sorted(CRASH_RATES)} or set crashes_per_gpu_day")
        lo, hi = self.human_day_hours
        if len(self.human_day_hours) != 2 or not 0 <= lo < hi <= 24:
            raise ConfigError(f"human_day_hours must be [start, end] with 0 <= start < end <= 24, "
                              f"got {list(self.human_day_hours)}")

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> "SimConfig":
        values: dict[str, Any] = dict(read_mapping(Path(path))) if path else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            check_tree(cls, values)
        except ConfigTreeError as exc:
            raise ConfigError(f"{path or 'simulate'}: {exc}") from None
        return cls(**values)

    def scenarios(self) -> dict[str, float]:
        """Name -> crashes per second for the whole run (rate per GPU-day x GPUs)."""
        if self.crashes_per_gpu_day is not None:
            return {"custom": self.crashes_per_gpu_day * self.gpus / 86_400}
        return {name: CRASH_RATES[name] * self.gpus / 86_400 for name in self.crash_scenarios}


def detector_figures(cfg: SimConfig) -> dict[str, DetectorFigures]:
    """The policy's and OLMo-core's rule's figures: from bench/divergence.py's cached JSON when
    it is there (the measured grid), else the figures of the last grid in BENCHMARKS.md; the
    config's detect_steps / false_actions_per_10k / miss_rate override the policy's."""
    figs = _measured(cfg)
    over = {k: getattr(cfg, k) for k in ("detect_steps", "false_actions_per_10k", "miss_rate")
            if getattr(cfg, k) is not None}
    if over:
        p = figs["policy"]
        figs["policy"] = dataclasses.replace(p, **over, source=f"{p.source}; overridden by the config: {over}")
    return figs


def _measured(cfg: SimConfig) -> dict[str, DetectorFigures]:
    path = Path(cfg.divergence_json) if cfg.divergence_json else None
    if path is not None and path.is_file():
        try:
            return _from_bench(json.loads(path.read_text().strip().splitlines()[-1]), str(path))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ConfigError(f"divergence_json: {path} is not bench/divergence.py's --json output ({exc}); "
                              "rerun `python bench/divergence.py --reuse --json` or point divergence_json elsewhere")
    src = "BENCHMARKS.md, bench/divergence.py --seeds 3 (no cached JSON found)"
    return {name: DetectorFigures(**vals, source=src) for name, vals in BENCH_DEFAULTS.items()}


def _from_bench(data: Mapping[str, Any], source: str) -> dict[str, DetectorFigures]:
    lags = [max(0, r["first_act"] - r["damage_step"]) for r in data["runs"]
            if r.get("damage_step") is not None and r.get("first_act") is not None]
    lag = int(statistics.median(lags)) if lags else BENCH_DEFAULTS["policy"]["detect_steps"]
    out = {}
    for name in ("policy", "olmo_core"):
        d = data["detectors"][name]
        out[name] = DetectorFigures(
            false_actions_per_10k=float(d["false_actions_per_10k"] or 0.0),
            miss_rate=1 - d["caught"] / d["n_damaged"] if d["n_damaged"] else 0.0,
            detect_steps=lag, source=source)
    return out
