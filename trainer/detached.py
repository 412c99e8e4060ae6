"""A run controller that outlives its driver (issue 13, item 3).

`thermowatch train CONFIG --supervisor URL --detach` does not run the controller in the
launching process: it creates one named, detached Ray actor, `ControllerActor`, that holds the
`RunController` and trains, with `max_restarts` set. Then:

- the launching process (a laptop's shell, a RayJob's submitter pod) only follows the actor's
  progress; killing it, or losing its machine, leaves the run training. Launching the same
  config again attaches to the running actor (it is found by name) instead of starting a
  second controller on the same run;
- when the actor's own process dies (SIGKILL, OOM, the node it sat on lost), Ray starts it
  again, on any node, with the same arguments: `__init__` builds a new `RunController`, which
  resumes from the newest valid checkpoint with the skip ledger and LR changes (manifest plus
  commands.json, DESIGN.md "Rollback semantics") as the next attempt of the same run
  (attempt.json on the checkpoint volume), so the supervisor sees a new attempt, not a new run.
  The old incarnation's ranks die with it (Ray's owner fate-sharing: the actor owned them and
  their placement group).

What must live where: the checkpoint directory and the sink's spool sit on the volume every
node mounts (a relaunched controller may land on another node and must find both); the
supervisor is reached over HTTP, never embedded (an embedded supervisor would die with the
process it lives in). The `ingest` token travels in the actor's runtime environment
(`THERMOWATCH_TOKEN`), as a KubeRay Secret mounted into the submitter would hand it on.

No step is lost by a controller's death: before a checkpoint commits, the controller waits
until the sink has posted or spooled (fsync'd) every record it holds (RunController's durability
barrier), so the steps up to the checkpoint a relaunch resumes from are already durable, and the
steps after it are trained again by the next attempt ("later attempts win").
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import traceback
from dataclasses import asdict
from typing import Any

from thermowatch.monitors.contract import AckWatch, StepRecord

log = logging.getLogger(__name__)

NAMESPACE = "thermowatch"  # the Ray namespace of every thermowatch controller actor
MAX_EVENTS = 2000  # progress events kept for a follower that polls late


def actor_name(run_id: str) -> str:
    """One controller per run: the name is the lock (Ray refuses a second actor of that name)."""
    return f"thermowatch-controller:{run_id}"


class _Events:
    """A bounded, numbered log of what happened (steps trained, commands acknowledged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[int, str, Any, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self.seq = 0

    def add(self, kind: str, a: Any, b: Any) -> None:
        with self._lock:
            self.seq += 1
            self._items.append((self.seq, kind, a, b))

    def since(self, seq: int) -> tuple[int, list[tuple[int, str, Any, Any]]]:
        with self._lock:
            return self.seq, [e for e in self._items if e[0] > seq]


class ControllerActor:
    """One run's controller inside a Ray actor (create it with `start`, not directly).

    Trains on a thread of its own from `__init__` on, so that `status` answers while it trains.
    Every incarnation (Ray restarts the actor after its process died) starts the controller
    afresh: a relaunch from the newest checkpoint, as the next attempt."""

    def __init__(self, config: dict[str, Any], supervisor_url: str, spool_dir: str) -> None:
        import ray

        from thermowatch.trainer.config import TrainConfig
        from thermowatch.trainer.controller import RunController
        from thermowatch.transport import HttpCommandChannel, HttpSink

        ctx = ray.get_runtime_context()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.node_id = ctx.get_node_id()
        self.cfg = TrainConfig.from_dict(config)
        token = os.environ.get("THERMOWATCH_TOKEN") or None
        self.sink = HttpSink(supervisor_url, spool_dir, token=token, batch_s=self.cfg.flush_every_s,
                             batch_steps=self.cfg.flush_every_steps, close_timeout=self.cfg.close_timeout_s)
        self.channel = HttpCommandChannel(supervisor_url, token=token)
        self.events = _Events()
        commands = AckWatch(self.channel, lambda _run, kind, ack: self.events.add("ack", kind, ack.to_json()))
        self.ctl = RunController(self.cfg, self.sink, commands, progress=self._on_step)
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self._thread = threading.Thread(target=self._main, name="thermowatch-controller", daemon=True)
        self._thread.start()
        log.info("controller for run %s up on node %s (pid %d)%s", self.cfg.run_id, self.node_id, os.getpid(),
                 ", restarted by Ray after its process died" if self.restarted else "")

    def _on_step(self, rec: StepRecord, attempt: int) -> None:
        self.events.add("step", attempt, rec.to_json())

    def _main(self) -> None:
        try:
            r = self.ctl.run()
            self.result = asdict(r) | {"acks": [a.to_json() for a in r.acks],
                                       "checkpoints": [c.to_json() for c in r.checkpoints]}
        except BaseException as exc:  # RunFailed (restarts exhausted) or a bug: the follower must hear it
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("run %s failed:\n%s", self.cfg.run_id, traceback.format_exc())
        finally:
            for close in (self.sink.close, self.channel.close):
                try:
                    close()  # the sink drains: "done" means the supervisor has (or the spool holds) every step
                except Exception:
                    log.exception("closing %s", close)
            self.done = True

    def status(self, since: int = 0) -> dict[str, Any]:
        """What a follower prints: the events after `since`, and whether the run has ended."""
        seq, events = self.events.since(since)
        return {"run_id": self.cfg.run_id, "pid": os.getpid(), "node_id": self.node_id, "restarted": self.restarted,
                "step": self.ctl.step, "attempt": self.ctl.attempt, "state": type(self.ctl.state).__name__,
                "done": self.done, "result": self.result, "error": self.error, "seq": seq, "events": events}


def start(config: dict[str, Any], supervisor_url: str, spool_dir: str, *, restarts: int,
          env: dict[str, str] | None = None) -> tuple[Any, bool]:
    """The run's controller actor: the one already running under the run's name (attach), else
    a new detached one. Returns (handle, created). Needs `ray.init` done (a cluster to live in)."""
    import ray

    name = actor_name(config["run_id"])
    try:
        return ray.get_actor(name, namespace=NAMESPACE), False
    except ValueError:
        pass
    actor = ray.remote(ControllerActor).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=restarts,  # Ray re-creates it after its process dies: __init__ resumes the run
        max_task_retries=0,  # a status() call during a restart fails fast; the follower asks again
        num_cpus=0,  # the ranks take the CPUs/GPUs; the controller only waits on them
        runtime_env={"env_vars": dict(env or {})},
    ).remote(config, supervisor_url, spool_dir)
    return actor, True
