"""What an on-call engineer's Slack receives for the demo's real divergence (issue 23: "one
incident's full Slack thread and the run-finished message, as the fake server recorded them").

    python bench/slack_story.py [--steps 200] [--json out.json]
    python bench/slack_story.py --advise-only [--escalate-after 10]

The demo's recipe (thermowatch/demo.py: a 2-rank ZeRO bf16 GPT on CPU through Ray, at an LR
that really diverges) supervised by the real Supervisor whose alerts go through the real outbox
and slack-sdk to tests/fakes/slack_server.py. Prints every top-level message with its severity
and, under it, its thread's replies in order, then the "run finished" message's blocks as text.

`--advise-only` (issue 37's on-call story): every action waits for a person, and the alerts also
go to a fake PagerDuty (Events API v2) and a fake SMTP server (tests/fakes), with the on-call
group @-mentioned on Slack. Nobody answers a page until it has escalated (the daemon's escalate
job, run on each poll here; `serve` schedules it), then the stand-in on-call approves it. Prints
what each channel received: the pages, their escalation, acknowledge and resolve.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes.pager_server import ROUTING_KEY, FakePagerDuty  # noqa: E402
from tests.fakes.slack_server import FakeSlack  # noqa: E402
from tests.fakes.smtp_server import FakeSMTP  # noqa: E402
from thermowatch.demo import DEMO_DETECTORS, DEMO_POLICY, DemoOptions, _NoHumanOnCall, train_config  # noqa: E402
from thermowatch.supervisor.app.config import SupervisorConfig  # noqa: E402
from thermowatch.supervisor.notify.slack import SlackNotifier  # noqa: E402
from thermowatch.supervisor.app.service import Supervisor, build_notifier  # noqa: E402
from thermowatch.supervisor.app import jobs  # noqa: E402
from thermowatch.supervisor.store import actions as actions_store  # noqa: E402
from thermowatch.supervisor.store import audit as audit_store  # noqa: E402


def _text(blocks) -> str:
    """The words of a message's blocks (sections and context), one line each."""
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks or []
    out = []
    for b in blocks:
        for part in [b.get("text")] + list(b.get("fields") or []) + list(b.get("elements") or []):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
    return "\n".join(out)


class _LateOnCall:
    """Advise-only: the on-call answers a page only after it escalated. The daemon's escalate job
    runs on each poll (`serve` schedules it); once a waiting proposal's page has escalated, it is
    approved. A pause with no proposal waiting (the policy's own: nobody is on call in a demo)
    stops the run, as the demo does."""

    def __init__(self, sup) -> None:
        self._sup = sup

    def _waiting(self, run_id: str) -> list:
        with self._sup.sessions() as s:
            return [a for a in actions_store.open_actions(s, run_id) if a.state == "pending" and a.requires_approval]

    def poll(self, run_id: str):
        sup = self._sup
        jobs.escalate(sup)
        with sup.sessions() as s:
            escalated = {e.detail.get("thread") for e in audit_store.events(s, run_id, jobs.ESCALATED)}
        for a in self._waiting(run_id):
            if f"incident:{a.incident_id}" in escalated:
                sup.executor.approve(a.id, "oncall (after the escalation)")
        cmds = sup.poll(run_id)
        if any(c.kind.value == "pause" for c in cmds) and not self._waiting(run_id):
            sup.executor.submit(run_id, "stop", {}, who="demo",
                                reason="the supervisor paused the run and paged; no human is on call in the demo")
        return cmds

    def ack(self, run_id: str, ack) -> None:
        self._sup.ack(run_id, ack)


def main() -> int:
    import ray

    from thermowatch.trainer.controller import RunController

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="shorten the demo's run")
    ap.add_argument("--json", type=Path, help="also write every message recorded, as JSON")
    ap.add_argument("--advise-only", action="store_true", help="every action waits for a person; PagerDuty and email too")
    ap.add_argument("--escalate-after", type=float, default=10.0, help="escalate_after_s for --advise-only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, FakeSlack() as slack, FakePagerDuty() as pd, FakeSMTP() as smtp:
        opts = DemoOptions(data_dir=Path(tmp), steps=args.steps, progress=False, run_id="slack-story")
        cfg = SupervisorConfig(data_dir=opts.data_dir, policy=DEMO_POLICY, detectors=DEMO_DETECTORS,
                               public_url="https://thermowatch.example")
        notifier = SlackNotifier(slack.token, "#train", base_url=slack.base_url, retries=1)
        if args.advise_only:
            (Path(tmp) / "bot-token").write_text(slack.token)
            (Path(tmp) / "pd-key").write_text(ROUTING_KEY)
            cfg = SupervisorConfig(
                data_dir=opts.data_dir, policy=DEMO_POLICY, detectors=DEMO_DETECTORS, advise_only=True,
                escalate_after_s=args.escalate_after,
                slack={"channel": "#train", "base_url": slack.base_url, "token_file": str(Path(tmp) / "bot-token"),
                       "signing_secret_env": "", "oncall": ["S0ONCALL"], "escalate_to": ["U0LEAD"]},
                pagerduty={"routing_key_file": str(Path(tmp) / "pd-key"), "base_url": pd.url},
                email={"host": "127.0.0.1", "port": smtp.port, "security": "none", "from_addr": "tw@example.org",
                       "to": ["oncall@example.org"], "escalate_to": ["lead@example.org"]})
            notifier = build_notifier(cfg)
        sup = Supervisor(cfg, notifier=notifier)
        tcfg = train_config(opts, opts.run_id, opts.data_dir / "checkpoints")
        ray.init(num_cpus=max(4, tcfg.world_size * 2), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        try:
            commands = _LateOnCall(sup) if args.advise_only else _NoHumanOnCall(sup)
            result = RunController(tcfg, sink=sup, commands=commands).run()
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
        if args.advise_only:
            mentioned = [m["text"] for m in slack.posted() if "<!subteam^" in m.get("text", "")]
            print(f"\nSlack messages that @-mention someone: {len(mentioned)}")
            for text in mentioned:
                print(f"    {text[:160]}")
            print(f"PagerDuty: {len(pd.incidents)} incident(s), events in order:")
            for ev in pd.events():
                print(f"    {ev['event_action']:12} {ev['dedup_key']}")
            print(f"email: {len(smtp.mails)} mail(s):")
            for mail in smtp.mails:
                print(f"    to {', '.join(mail.rcpt_to)}: {mail.subject[:120]}")
        if args.json:
            args.json.write_text(json.dumps(slack.posted(), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
