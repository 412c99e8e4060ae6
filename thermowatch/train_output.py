"""What `thermowatch train` prints on stderr while the run trains (issue 12, item 5).

One progress line every `every` steps and one line per command the controller acknowledged:

    cluster-1 step 40/100: loss 2.3142, 61,203 tok/s, max attn logit <= 12.8, ETA 0:00:21
    cluster-1 command 7 rollback: done at step 21 (checkpoint 20; skipped 2 range(s); lr x1)

They never begin with "run <id>: step", the final line's prefix, which tests and benchmarks grep.
Before this, 156 of 173 lines were httpx's INFO log of every command poll: `quiet_http_logs`
turns those off unless `--verbose`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import IO, Callable

from thermowatch.monitors.commands import Ack
from thermowatch.monitors.contract import ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, LOSS, TOKENS_PER_S, AckWatch, CommandChannel, StepRecord

HTTP_LOGGERS = ("httpx", "httpcore")


def quiet_http_logs(verbose: bool) -> None:
    """The HTTP client logs every request at INFO: one line per command poll, four a second."""
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


class Progress:
    """The controller's `progress` callback: a line every `every` steps, and at the last step."""

    def __init__(self, run_id: str, total_steps: int, every: int = 10, out: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id, self.total, self.every = run_id, total_steps, max(1, every)
        self.out = out or sys.stderr
        self.clock = clock
        self._t0: float | None = None
        self._first_step = 0

    def __call__(self, rec: StepRecord, attempt: int) -> None:
        now = self.clock()
        if self._t0 is None or rec.step < self._first_step:  # the first record, or a rollback
            self._t0, self._first_step = now, rec.step
        if rec.step % self.every and rec.step != self.total:
            return
        print(self.line(rec, now), file=self.out, flush=True)

    def line(self, rec: StepRecord, now: float) -> str:
        v = rec.values
        # NaN where a layer was not measured this step (attn_every > 1) or has diverged: max() over
        # a list holding NaN depends on its order, so NaNs count only when nothing else is there.
        # The exact max where measured (attn_mode "exact"); else the log-sum-exp bound, the
        # default mode's thermometer: max <= lse <= max + ln(keys), shown as "<=".
        attn = [x for k, x in v.items() if k.split("/")[0] == ATTN_LOGIT_MAX]
        bound = "" if attn else "<= "
        attn = attn or [x for k, x in v.items() if k.split("/")[0] == ATTN_LOGIT_LSE]
        attn = [x for x in attn if not math.isnan(x)] or attn
        parts = [f"loss {v.get(LOSS, math.nan):.4f}"]
        if TOKENS_PER_S in v:
            parts.append(f"{v[TOKENS_PER_S]:,.0f} tok/s")
        if attn:
            parts.append(f"max attn logit {bound}{max(attn):.1f}")
        done = rec.step - self._first_step
        if done > 0 and self._t0 is not None:
            left = (now - self._t0) / done * max(0, self.total - rec.step)
            parts.append(f"ETA {_hms(left)}")
        return f"{self.run_id} step {rec.step}/{self.total}: " + ", ".join(parts)


def announced_commands(inner: CommandChannel, out: IO[str] | None = None) -> AckWatch:
    """A CommandChannel that says on stderr what each command did, as the trainer acknowledges it."""
    out = out or sys.stderr
    return AckWatch(inner, lambda run_id, kind, ack: print(ack_line(run_id, kind, ack), file=out, flush=True))


def ack_line(run_id: str, kind: str, ack: Ack) -> str:
    what = []
    if ack.checkpoint_step is not None:
        what.append(f"checkpoint {ack.checkpoint_step}")
    if ack.skip_ranges:
        what.append(f"skipped {len(ack.skip_ranges)} range(s)")
    if ack.lr_multiplier is not None:
        what.append(f"lr x{ack.lr_multiplier:g}")
    if ack.detail:
        what.append(ack.detail)
    state = "done" if ack.ok else "FAILED"
    return f"{run_id} command {ack.command_id} {kind}: {state} at step {ack.first_step}" + (
        f" ({'; '.join(what)})" if what else "")


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
