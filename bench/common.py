"""What the benches share (issue 38 item 5): the repository on sys.path, a daemon subprocess's
port, token, environment and start-up wait, the model-size flags, and the side-by-side method:
variants run in blocks whose order rotates every round, each figure a median of paired ratios.

A bench imports it as `common`: `python bench/X.py` puts bench/ first on sys.path.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.fixtures and tests.live_server import from the checkout
    sys.path.insert(0, str(REPO))

from tests.live_server import free_port  # noqa: E402,F401  (re-exported: every daemon bench needs a port)

T = TypeVar("T")


def new_token() -> str:
    """A fresh admin token for a daemon started here: auth on, as deployed."""
    return "tw_" + secrets.token_urlsafe(32)


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (a subprocess imports
    this tree, not an installed copy), plus `extra`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra)


def wait_up(probe: Callable[[], bool | None], proc: subprocess.Popen, fail: str, timeout_s: float = 120.0,
            every_s: float = 0.2) -> None:
    """Call `probe` until it answers anything but False without a transport error; RuntimeError
    `fail` if `proc` exits or `timeout_s` passes first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if probe() is not False:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(fail) from None
        time.sleep(every_s)


def add_model_flags(ap: argparse.ArgumentParser, *, heads: bool = True, seq_len: int = 128) -> None:
    """The model-size flags of the overhead benches (a 4-layer d128 GPT by default)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    if heads:
        ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--batch", type=int, default=8)


def nano_model(args: argparse.Namespace):
    """(model, device): --threads torch threads, seed 0, and tests/fixtures/nanogpt.py's GPT (its
    attention calls F.scaled_dot_product_attention) from add_model_flags' flags and --vocab, on --device."""
    import torch

    from tests.fixtures.nanogpt import NanoConfig, NanoGPT

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = NanoConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.d_model)
    return NanoGPT(cfg).to(dev), dev


def rotating_rounds(names: Sequence[str], run: Callable[[str, int], T], *, warmup: int, steps: int,
                    block: int) -> dict[str, list[T]]:
    """`run(name, warmup)` once per variant, unmeasured; then max(1, steps // block) rounds of
    `run(name, block)` over every variant, the order rotated by one each round (plain, a, b; a, b,
    plain; ...) so that machine noise hits every variant alike. Each variant's results, by round."""
    for name in names:
        run(name, warmup)
    out: dict[str, list[T]] = {k: [] for k in names}
    for r in range(max(1, steps // block)):
        k = r % len(names)
        for name in list(names[k:]) + list(names[:k]):
            out[name].append(run(name, block))
    return out


def paired_ratios(times: dict[str, list[float]], base: str = "plain") -> dict[str, float]:
    """Each variant's median over rounds of its time / `base`'s time in the same round."""
    return {k: statistics.median(a / p for a, p in zip(v, times[base])) for k, v in times.items()}


def paired_ratio_ci(times: dict[str, list[float]], base: str = "plain") -> dict[str, tuple[float, float]]:
    """A distribution-free ~95% interval for each variant's median paired ratio (paired_ratios):
    the order statistics n/2 -+ 0.98*sqrt(n) of its per-round ratios (the binomial interval of a
    median; no normality assumed). Its half-width is the spread a figure is read with."""
    out = {}
    for k, v in times.items():
        r = sorted(a / p for a, p in zip(v, times[base]))
        n = len(r)
        lo, hi = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n))), min(n - 1, math.ceil(n / 2 + 0.98 * math.sqrt(n)))
        out[k] = (r[lo], r[hi])
    return out
