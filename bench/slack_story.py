"""What an on-call engineer's Slack receives for the demo's real divergence (issue 23: "one
incident's full Slack thread and the run-finished message, as the fake server recorded them").

    python bench/slack_story.py [--steps 200] [--json out.json]

The demo's recipe (thermowatch/demo.py: a 2-rank ZeRO bf16 GPT on CPU through Ray, at an LR
that really diverges) supervised by the real Supervisor whose alerts go through the real outbox
and slack-sdk to tests/fakes/slack_server.py. Prints every top-level message with its severity
and, under it, its thread's replies in order, then the "run finished" message's blocks as text.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes.slack_server import FakeSlack  # noqa: E402
from thermowatch.demo import DEMO_DETECTORS, DEMO_POLICY, DemoOptions, _NoHumanOnCall, train_config  # noqa: E402
from thermowatch.supervisor.app.config import SupervisorConfig  # noqa: E402
from thermowatch.supervisor.notify.slack import SlackNotifier  # noqa: E402
from thermowatch.supervisor.app.service import Supervisor  # noqa: E402


def _text(blocks) -> str:
    """The words of a message's blocks (sections and context), one line each."""
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks or []
    out = []
    for b in blocks:
        for part in [b.get("text")] + list(b.get("fields") or []) + list(b.get("elements") or []):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
    return "\n".join(out)


def main() -> int:
    import ray

    from thermowatch.trainer.controller import RunController

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="shorten the demo's run")
    ap.add_argument("--json", type=Path, help="also write every message recorded, as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, FakeSlack() as slack:
        opts = DemoOptions(data_dir=Path(tmp), steps=args.steps, progress=False, run_id="slack-story")
        cfg = SupervisorConfig(data_dir=opts.data_dir, policy=DEMO_POLICY, detectors=DEMO_DETECTORS,
                               public_url="https://thermowatch.example")
        sup = Supervisor(cfg, notifier=SlackNotifier(slack.token, "#train", base_url=slack.base_url, retries=1))
        tcfg = train_config(opts, opts.run_id, opts.data_dir / "checkpoints")
        ray.init(num_cpus=max(4, tcfg.world_size * 2), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        try:
            result = RunController(tcfg, sink=sup, commands=_NoHumanOnCall(sup)).run()
            sup.executor.outbox.drain(60)
        finally:
            sup.close()
            ray.shutdown()
        print(f"run {opts.run_id}: final step {result.final_step}, attempts {result.attempts}\n")
        for top in slack.top_level():
            print(f"* {top['text']}")
            for reply in slack.thread(top["ts"])[1:]:
                print(f"    > {reply.get('text', '')}" + (" [file]" if reply.get("subtype") == "file_share" else ""))
        done = [m for m in slack.top_level() if " finished (" in m["text"]]
        if done:
            print("\nthe run-finished message, as its blocks read:\n" + _text(done[-1].get("blocks")))
        if args.json:
            args.json.write_text(json.dumps(slack.posted(), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
