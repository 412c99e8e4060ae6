"""The pieces of a user's own training loop the client tests share: the model (nanoGPT, attention
through SDPA: tests/fixtures/nanogpt.py), a fixed map from sample ids to data, one step."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.fixtures.nanogpt import NanoConfig, NanoGPT

REPO = Path(__file__).resolve().parents[2]
DATA = torch.frombuffer(bytearray((REPO / "README.md").read_bytes()), dtype=torch.uint8).long()
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
