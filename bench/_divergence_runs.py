"""The real training runs behind bench/divergence.py: one tiny GPT per RunSpec (architecture, LR
schedule, qk_layernorm, seed), every step's full thermometer record written as JSONL that
`thermowatch replay FILE` reads.

One process per run, no Ray/DeepSpeed (the benchmark measures detectors, not the engine):
trainer.model.GPT on the standard library's bytes through trainer.data's DataLoader, AdamW with
decoupled weight decay on matrices only, global-norm clipping, linear warmup then constant LR.

Precision: fp32 master weights (GPTConfig(dtype="float32")). The forward pass runs in fp32 by
default (RunSpec.bf16: bf16 autocast is ~10x slower on CPUs without AMX, which a 40-run grid
under 15 minutes cannot afford); with bf16=True it runs under `torch.autocast("cpu",
dtype=torch.bfloat16)` as the real trainer's matmuls do, AdamW still updating fp32 weights.

A sidecar `<name>.meta.json` holds the run's settings and a fingerprint of the code that trained
it; `--reuse` serves a cached JSONL only when both match.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Code whose change makes a cached run stale.
_CODE = ("trainer/model.py", "trainer/data/loader.py", "trainer/data/sources.py", "trainer/data/order.py",
         "monitors/thermometers/core.py", "monitors/thermometers/attention.py", "monitors/thermometers/config.py",
         "monitors/thermometers/slots.py", "monitors/thermometers/update.py", "bench/_divergence_runs.py")


@dataclass(frozen=True)
class RunSpec:
    peak_lr: float
    qk_layernorm: bool = False
    seed: int = 0
    steps: int = 300
    warmup_steps: int = 100  # linear warmup, then constant (the fixture's and the demo's recipe)
    # The grid's two architectures: LayerNorm + GELU (GPT-2, nanoGPT) and RMSNorm + ReLU^2
    # (modded-nanogpt). Passed to GPTConfig only when they differ from its defaults.
    norm: str = "layernorm"
    activation: str = "gelu"
    # After warmup: "constant", or "cosine" down to 10 % of peak at the last step.
    decay: str = "constant"
    # A mid-run LR jump: from step `jump_at` on the LR is multiplied by `jump_factor` (0: none).
    jump_at: int = 0
    jump_factor: float = 1.0
    n_layer: int = 3
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 64
    batch: int = 16
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    # bf16 autocast matmuls are ~10x slower than fp32 on these CPUs (no AMX): 1.4 s against
    # 0.1 s per step at 4L d128, which puts a 40-run grid far past 15 minutes. The grid trains
    # in fp32; attention-logit growth is an LR phenomenon (Wortsman et al. 2023, small-scale
    # proxies) and shows without bf16. Set True to reproduce the bf16 numbers of older tables.
    bf16: bool = False
    max_bytes: int = 1 << 20  # 1 MB of stdlib text: loads in well under a second, ~16k windows
    tag: str = ""  # what the run stands for in the grid (healthy, late, jump, ...)

    def __post_init__(self) -> None:
        if self.decay not in ("constant", "cosine"):
            raise ValueError(f"RunSpec.decay={self.decay!r}; use 'constant' or 'cosine'")

    @property
    def arch(self) -> str:
        return "ln-gelu" if (self.norm, self.activation) == ("layernorm", "gelu") else f"{self.norm}-{self.activation}"

    @property
    def name(self) -> str:
        extra = ""
        if self.arch != "ln-gelu":
            extra += "_rms-relu2" if self.arch == "rmsnorm-relu2" else f"_{self.arch}"
        if self.warmup_steps != 100:
            extra += f"_w{self.warmup_steps}"
        if self.decay != "constant":
            extra += f"_{self.decay}"
        if self.jump_at:
            extra += f"_j{self.jump_at}x{self.jump_factor:g}"
        if self.bf16:
            extra += "_bf16"
        return f"lr{self.peak_lr:.0e}_qk{int(self.qk_layernorm)}{extra}_s{self.seed}_n{self.steps}"

    def lr_at(self, step: int) -> float:
        """1-based step, as trainer.lr: linear warmup to peak_lr, then constant or cosine to
        10 %; times `jump_factor` from `jump_at` on."""
        lr = self.peak_lr * min(1.0, step / self.warmup_steps)
        if self.decay == "cosine" and step > self.warmup_steps:
            frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
            lr = self.peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        if self.jump_at and step >= self.jump_at:
            lr *= self.jump_factor
        return lr

    def peak_ahead(self, step: int) -> float:
        """What the real trainer sends as `lr_peak_ahead` (trainer.lr.LRSchedule.peak_from): the
        largest LR of the schedule from `step` on, times the jump factor in force at `step`. A
        jump still to come is not in it: it stands for an operator's change, which no schedule
        forecasts."""
        base = self.peak_lr if step <= self.warmup_steps else replace(self, jump_at=0).lr_at(step)
        return base * (self.jump_factor if self.jump_at and step >= self.jump_at else 1.0)


def fingerprint(spec: RunSpec) -> str:
    import torch

    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    for rel in _CODE:
        h.update((REPO / rel).read_bytes())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:20]


def paths(out_dir: Path, spec: RunSpec) -> tuple[Path, Path]:
    return out_dir / f"{spec.name}.jsonl", out_dir / f"{spec.name}.meta.json"


def cached(out_dir: Path, spec: RunSpec) -> bool:
    log, meta = paths(out_dir, spec)
    if not (log.is_file() and meta.is_file()):
        return False
    try:
        m = json.loads(meta.read_text())
    except ValueError:
        return False
    return m.get("fingerprint") == fingerprint(spec) and m.get("complete") is True


def train(spec: RunSpec, out_dir: str | os.PathLike[str], threads: int = 1) -> dict:
    """Train one run and write its JSONL + meta. Returns the meta dict (with train seconds)."""
    import torch

    from thermowatch.monitors.contract import LR_PEAK_AHEAD, StepRecord
    from thermowatch.monitors.thermometers import ThermometerConfig, instrument
    from thermowatch.trainer.data import DataConfig, DataLoader, stdlib_source
    from thermowatch.trainer.model import GPT, GPTConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log, meta_path = paths(out, spec)
    torch.set_num_threads(threads)  # one thread per run: two runs share the 2 cores side by side
    torch.manual_seed(spec.seed)
    arch = {}
    if spec.norm != "layernorm":
        arch["norm"] = spec.norm
    if spec.activation != "gelu":
        arch["activation"] = spec.activation
    cfg = GPTConfig(n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model, seq_len=spec.seq_len,
                    qk_layernorm=spec.qk_layernorm, dtype="float32", **arch)  # fp32 master weights
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.peak_lr, betas=(0.9, 0.95))
    loader = DataLoader(stdlib_source(spec.max_bytes),
                        DataConfig(seq_len=spec.seq_len, global_batch=spec.batch, seed=spec.seed,
                                   max_bytes=spec.max_bytes))
    tmp = log.with_suffix(f".{os.getpid()}.tmp")
    t0 = time.perf_counter()
    # Every group every step (budget=None): the default budget's cadences follow the measured cost,
    # so the machine's load at record time would decide which steps carry which keys (two
    # recordings of the same code differed on 4-76 steps per run, session 26). `--thin` replays a
    # budget's cadences from these, the same way each time.
    with instrument(model, ThermometerConfig(budget=None)) as th, tmp.open("w") as fh:
        for step in range(1, spec.steps + 1):
            lr = spec.lr_at(step)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = loader.next_batch()
            th.begin_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
                _, loss = model(batch.inputs, batch.targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)  # pre-clip norm
            with th.measure_update():  # update_ratio on sampled steps, as trainer/worker.py does
                opt.step()
            th.end_step(loss=loss, lr=lr, grad_norm=norm)
            values = {**th.as_dict(th.collect()), LR_PEAK_AHEAD: spec.peak_ahead(step)}
            rec = StepRecord(step=step, values=values, sample_lo=batch.sample_lo,
                             sample_hi=batch.sample_hi, tokens=batch.tokens, wall_time=time.time())
            fh.write(json.dumps(rec.to_json()) + "\n")  # NaN/Inf as JSON literals, as replay reads them
    tmp.replace(log)
    meta = {"spec": asdict(spec), "fingerprint": fingerprint(spec), "complete": True,
            "train_s": round(time.perf_counter() - t0, 2), "params": model.num_params(), "torch": torch.__version__}
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def train_job(job: tuple[dict, str]) -> dict:
    """Pool entry point (picklable): (asdict(spec), out_dir) -> meta."""
    spec, out_dir = job
    return train(RunSpec(**spec), out_dir)
