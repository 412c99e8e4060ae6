"""How long `tw.close()` takes when the daemon is slow, silent or gone, and where the tail goes
(issue 34: 60 s when every answer was 2 s late, 122 s when the daemon accepted and never
answered; with the daemon down at close, 169 of 400 steps and the "finished" report stayed in a
spool until something reused the directory).

    python bench/close_bound.py                      # every scenario, the default close_timeout_s
    python bench/close_bound.py --close-timeout 10 --only late silent

Scenarios (a nanoGPT of tests/client/user_loop trained `--steps` steps with thermowatch.watch over
HTTP against a real daemon on SQLite; the faults are tests/fakes/network.py):
  late    every answer 2 s late (a proxy in front of the daemon): close()'s wall time
  silent  a host that accepts connections and never answers: close()'s wall time
  down    the daemon stopped at step 231: close()'s time, what the spool holds, then
          `thermowatch flush DIR` against the daemon brought back: its exit code and the steps stored
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import thermowatch  # noqa: E402
from tests.client.user_loop import DATA, train_step, user_batch, user_model  # noqa: E402
from tests.fakes.network import LateProxy, Silent  # noqa: E402
from tests.live_server import running  # noqa: E402
from tests.supervisor.auth_helpers import ADMIN_TOKEN, make_token  # noqa: E402


def daemon(tmp: Path):
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.notify.console import ConsoleNotifier

    sup = Supervisor(SupervisorConfig(data_dir=tmp / "daemon", db_url=f"sqlite:///{tmp / 'tw.db'}", api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    return sup, make_token(sup.sessions, "trainer", "ingest")


def watch(url: str, token: str, ckpt: Path, steps: int, close_timeout: float | None):
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    kw = {} if close_timeout is None else {"close_timeout_s": close_timeout}
    tw = thermowatch.watch(model, opt, run="close-bench", steps=steps, global_batch=4, server=url, token=token,
                           checkpoint_dir=ckpt, checkpoint_every=50, **kw)
    return tw, model, opt


def train(tw, model, opt, it, upto: int | None = None) -> None:
    """Train the steps of `it` (tw.steps()), up to step `upto` included."""
    for step in it:
        tw.record(train_step(model, opt, *user_batch(DATA, tw.batch_ids(step))))
        if step == upto:
            return


def closing(tw) -> float:
    t0 = time.monotonic()
    tw.close()
    return time.monotonic() - t0


def stored_steps(sup, run_id: str = "close-bench") -> int:
    from thermowatch.supervisor.store import thermometers

    with sup.sessions() as s:
        return len(thermometers.history(s, run_id, "loss")[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--close-timeout", type=float, default=None, help="close_timeout_s (default: the client's)")
    ap.add_argument("--only", nargs="*", default=["late", "silent", "down"])
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  log: %(levelname)s %(name)s: %(message)s")
    for name in args.only:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            sup, token = daemon(tmp)
            from thermowatch.supervisor.serve.server import build_app

            try:
                if name == "late":
                    with running(build_app(sup)) as url, LateProxy(url, 2.0) as proxy:
                        tw, model, opt = watch(proxy.url, token, tmp / "ckpt", args.steps, args.close_timeout)
                        train(tw, model, opt, tw.steps())
                        took = closing(tw)
                    print(f"late:   close() {took:.1f} s; {stored_steps(sup)} of {args.steps} steps stored by then")
                elif name == "silent":
                    with Silent() as silent:
                        tw, model, opt = watch(silent.url, token, tmp / "ckpt", args.steps, args.close_timeout)
                        train(tw, model, opt, tw.steps())
                        took = closing(tw)
                    print(f"silent: close() {took:.1f} s")
                else:
                    with running(build_app(sup)) as url:
                        tw, model, opt = watch(url, token, tmp / "ckpt", args.steps, args.close_timeout)
                        it = tw.steps()
                        train(tw, model, opt, it, upto=231)
                    train(tw, model, opt, it)  # the daemon is down from step 232 on
                    took = closing(tw)
                    print(f"down:   close() {took:.1f} s; {stored_steps(sup)} of {args.steps} steps stored")
                    spool = tmp / "ckpt" / "spool"
                    left = sorted(p.name for p in spool.iterdir()) if spool.is_dir() else []
                    print(f"        left in {spool}: {left}")
                    if left:
                        from thermowatch.cli import main as cli

                        with running(build_app(sup)) as url:
                            try:
                                rc = cli(["flush", str(spool), "--server", url, "--token", token])
                            except SystemExit as exc:  # no `flush` command in this version
                                rc = exc.code
                        print(f"        thermowatch flush: exit {rc}; {stored_steps(sup)} of {args.steps} steps stored")
            finally:
                sup.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
