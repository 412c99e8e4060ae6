"""The pieces of a user's own training loop the client tests share: the model (nanoGPT, attention
through SDPA: tests/fixtures/nanogpt.py), a fixed map from sample ids to data, one step; and
`calm` and `diverging`: that model at a healthy learning rate and at one that really diverges,
watched by an in-process daemon."""

from __future__ import annotations

from pathlib import Path

import torch

import thermowatch
from tests.fixtures.nanogpt import NanoConfig, NanoGPT
from thermowatch.supervisor.app.config import SupervisorConfig

# Fixed text to train on: README.md as of 62dd0c1. It was README.md itself, so every README edit
# changed what these loops train on and where their losses spike (a row added at the top of its
# timing table moved an automatic rollback's target from 15 to 5 in test_checkpoint_trust).
REPO = Path(__file__).resolve().parents[2]
DATA_FILE = REPO / "tests" / "data" / "user_loop.txt"
DATA = torch.frombuffer(bytearray(DATA_FILE.read_bytes()), dtype=torch.uint8).long()
SEQ, B = 16, 4


def user_model(seq: int = SEQ, heads: int = 2, d: int = 32) -> NanoGPT:
    """A user's own model (tests/fixtures/nanogpt.py: nanoGPT, attention through SDPA)."""
    return NanoGPT(NanoConfig(vocab_size=256, block_size=seq, n_layer=2, n_head=heads, n_embd=d))


def user_batch(data: torch.Tensor, ids, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample id i is the window at (i * 7919) mod the data: any fixed map from ids to data works."""
    starts = (torch.as_tensor(ids) * 7919) % (len(data) - seq - 1)
    w = data[starts[:, None] + torch.arange(seq + 1)]
    return w[:, :-1], w[:, 1:]


def train_step(model: NanoGPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step of the user's loop: forward, backward, optimizer step; the loss, on its device."""
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def diverging(db, tmp_path, run: str, *, policy: dict | None = None, **watch_kw):
    """A user's SDPA model (d64, 4 heads, T32) trained with Adam at LR 0.1, a rate at which its
    attention logits really grow, watched (400 steps, batch 8) by an in-process daemon on `db` with
    tests/fixtures/diverging.py's detectors and policy (`policy` overrides some of it). Returns
    (model, optimizer, data, the Watch)."""
    from tests.fixtures.diverging import DETECTORS, POLICY

    torch.manual_seed(0)
    data = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(1))
    model = user_model(seq=32, heads=4, d=64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url, detectors=dict(DETECTORS),
                           policy={**POLICY, **(policy or {})})
    tw = thermowatch.watch(model, opt, run=run, steps=400, global_batch=8, checkpoint_dir=tmp_path / "ckpt",
                           supervisor_config=cfg, **watch_kw)
    return model, opt, data, tw


def calm(db, tmp_path, run: str, steps: int, *, sup: dict | None = None, **watch_kw):
    """A user's model trained with AdamW at LR 1e-3 (healthy), watched (batch B, a checkpoint every
    5 steps, a poll every 0.05 s unless `watch_kw` says otherwise) by an in-process daemon on `db`
    (`sup`: more of its SupervisorConfig). Returns (the Watch, model, optimizer)."""
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url, **(sup or {}))
    tw = thermowatch.watch(model, opt, run=run, steps=steps, checkpoint_dir=tmp_path / "ckpt", supervisor_config=cfg,
                           **{"global_batch": B, "checkpoint_every": 5, "poll_interval_s": 0.05, **watch_kw})
    return tw, model, opt
