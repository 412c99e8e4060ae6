"""One training rank: model + DeepSpeed engine + thermometers + data, driven step by step.

The run controller makes one `TrainWorker` Ray actor per rank (`Gang` below) and calls
`setup` on all of them at once (torch.distributed's rendezvous needs every rank), then `step`
on all of them for every step. Everything the controller decides (LR changes, skips, the data
state, which checkpoint to load) arrives through these methods; the worker holds no policy.

Determinism: the data batch is a pure function of the data state, the LR of the step, and the
torch RNG is reseeded from (seed, step, rank) every step, so a rollback replays bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from thermowatch.monitors.contract import LOSS, TOKENS_PER_S, LRChange, ledger_digest, multiplier_at
from thermowatch.trainer.seam import RankReady, TrainedStep

log = logging.getLogger(__name__)


PROBE = -1  # the attempt a probe step's samples are recorded under (sample_ids_seen)


class Faults:
    """A rank's part of a fault drill (TrainConfig.faults, issue 39): each fault real training
    with one thing broken. Off, every call is a branch."""

    def __init__(self, cfg: Any, rank: int, vocab: int) -> None:
        self.cfg, self.vocab = cfg, vocab
        lo, hi = cfg.poison
        self.poison = (lo, hi) if hi > lo else None
        self.flips = bool(cfg.flip_step) and rank == cfg.flip_rank
        self._due = self.fired = False

    def arm(self, module: Any) -> None:
        """A forward hook on the first block's MLP that sets one output element's exponent bits
        (NaN, as a flipped exponent reads) when the flip is due."""
        import torch

        def flip(_mod: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            if not self._due:
                return None
            self._due, self.fired = False, True
            output = output.clone()
            output.view(-1)[0] = float("nan")
            return output

        block = next(m for name, m in module.named_modules() if name.endswith("mlp"))
        block.register_forward_hook(flip)

    def at(self, step: int, attempt: int) -> None:
        """The flip is due at its step of the run's first attempt, once (a replay does not repeat it)."""
        self._due = self.flips and not self.fired and attempt == 0 and step == self.cfg.flip_step

    def lr_factor(self, step: int) -> float:
        return self.cfg.lr_factor if self.cfg.lr_step and step >= self.cfg.lr_step else 1.0

    def batch(self, batch: Any) -> Any:
        """Samples in the poisoned range become uniformly random tokens, seeded by their id."""
        if self.poison is None:
            return batch
        import torch

        bad = (batch.sample_ids >= self.poison[0]) & (batch.sample_ids < self.poison[1])
        if not bad.any():
            return batch
        x, y = batch.inputs.clone(), batch.targets.clone()
        for row in np.flatnonzero(bad):  # a drill's few rows, not a hot path
            g = torch.Generator().manual_seed(int(batch.sample_ids[row]))
            noise = torch.randint(0, self.vocab, (x.shape[1] + 1,), generator=g)
            x[row], y[row] = noise[:-1], noise[1:]
        return dataclasses.replace(batch, inputs=x, targets=y)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TrainWorker:
    """Use as a Ray actor (`ray.remote(TrainWorker)`); plain methods, typed values across the
    seam (trainer.seam, contract.LRChange)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.attempt = 0
        self._engine = None
        # (attempt, step, sample ids) of the latest steps, for tests and forensics; bounded so a
        # long run does not grow it without limit.
        self._seen: deque[tuple[int, int, np.ndarray]] = deque(maxlen=4096)
        # This rank's own losses of the path since its data state was set, left on the device (no
        # sync per step): read only when a rollback asks which rank broke alone (own_losses).
        self._own: deque[tuple[int, Any]] = deque(maxlen=256)
        self._probing = False  # a precise skip's probe step: recorded in _seen as PROBE, not the attempt's
        self._held: dict[int, dict[str, Any]] = {}  # ended steps not yet handed out: TrainedStep's fields so far
        self._profiler = None
        self._profile_left = 0

    # --- bring-up -----------------------------------------------------------------------------

    def address(self) -> tuple[str, int, str]:
        """(this node's IP, a free port, Ray's node id): rank 0's IP and port become the
        rendezvous address; the node id names the machine (several nodes may share an IP)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port(), ray.get_runtime_context().get_node_id()

    def setup(
        self,
        config: dict[str, Any],
        attempt: int,
        data_state: dict[str, Any] | None,
        lr_changes: list[LRChange],
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        local_rank: int = 0,
        local_size: int = 1,
    ) -> RankReady:
        """Join the process group, build model, engine, thermometers and data loader."""
        from thermowatch.trainer.config import TrainConfig

        cfg = TrainConfig.from_dict(config)
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_SIZE=str(local_size),  # DeepSpeed's CPU accelerator counts devices from it
        )
        if not cfg.use_gpu:
            os.environ["DS_ACCELERATOR"] = "cpu"  # must precede the first deepspeed import
        import deepspeed
        import torch

        from thermowatch.monitors.thermometers import instrument
        from thermowatch.trainer.data import DataLoader, DataState
        from thermowatch.trainer.engine import Engine, decline_shm_comm_op
        from thermowatch.trainer.model import GPT

        if not cfg.use_gpu:
            torch.set_num_threads(max(1, int(cfg.cpus_per_rank)))
            decline_shm_comm_op()
        deepspeed.init_distributed(dist_backend="nccl" if cfg.use_gpu else "gloo")
        self.cfg, self.attempt = cfg, attempt
        torch.manual_seed(cfg.seed)  # identical init on every rank (ZeRO 3 partitions it after)
        model = GPT(cfg.model)
        self.flops_per_token = model.flops_per_token()
        self._engine = Engine(cfg, model, on_gpu=cfg.use_gpu)
        tcfg = cfg.thermometer_config()
        if cfg.zero_stage < 3:  # ZeRO 1/2 ranks hold identical weights: each copies 1/world for update_ratio
            tcfg = dataclasses.replace(tcfg, update_split=True)
        self.thermo = instrument(self._engine.module, tcfg)
        self._read_late = cfg.read_late if cfg.read_late is not None else self.thermo.device.type == "cuda"
        self.names = list(self.thermo.names) + [TOKENS_PER_S]
        self._loss_slot = self.names.index(LOSS)
        # "collective": the ranks reduce on the device and rank 0 alone hands out the step;
        # "driver": every rank hands out its own vector and the controller reduces them.
        self._collective = cfg.reduction == "collective"
        if self._collective:
            from thermowatch.monitors.collective import CollectiveReducer

            self.thermo.finish = CollectiveReducer(self.names, len(self.thermo.names), self.thermo.device,
                                                   self.rank, self.world_size)
        self.schedule = cfg.lr_schedule()
        self.lr_changes = list(lr_changes)
        state = DataState.from_json(data_state) if data_state else None
        self.loader = DataLoader.from_config(cfg.data, self.rank, self.world_size, state=state)
        self._note_ledger()
        self.faults = Faults(cfg.faults, self.rank, cfg.model.vocab_size)
        if self.faults.flips:
            self.faults.arm(self._engine.module)
        return RankReady(names=self.names, host=socket.gethostname(), flops_per_token=self.flops_per_token)

    # --- training -----------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        return self.loader.state.step + 1

    def step(self, step: int) -> TrainedStep | None:
        """Train (1-based) `step`. Returns the *previous* step (its values aligned with `names`),
        read a step late so that training never waits for the thermometers' host copy
        (DESIGN.md, "Nothing blocks training"; `TrainConfig.read_late`, on by default on a GPU);
        None on the first step after a (re)start or a `drain()`. `drain()` hands out the step
        still held back. With read_late off it returns this step's own values."""
        import torch

        from thermowatch.trainer.lr import lr_at

        if step != self.next_step:
            raise RuntimeError(
                f"rank {self.rank} was asked for step {step} but its data state is at step {self.next_step - 1}; "
                "the controller must load a checkpoint or set_data_state before skipping ahead"
            )
        t0 = time.perf_counter()
        self._profile_tick()
        batch = self.faults.batch(self.loader.next_batch())  # a fault drill's poisoned samples (cfg.faults)
        self.faults.at(step, self.attempt)
        # Dropout (if any) becomes a pure function of the step: replay after rollback is exact.
        torch.manual_seed((self.cfg.seed * 1_000_003 + step) * 4099 + self.rank)
        # What this rank really trains with goes into the record (DESIGN.md, "Trust"): the
        # supervisor compares it with the commands it booked.
        multiplier = multiplier_at(step, self.lr_changes)
        lr = lr_at(step, self.schedule, self.lr_changes) * self.faults.lr_factor(step)
        self._engine.set_lr(lr)
        self.thermo.begin_step(step)
        loss, norm = self._engine.train_step(batch.inputs, batch.targets, self.thermo.measure_update)
        dt = time.perf_counter() - t0  # before end_step: the collective reduction takes tokens/s in
        # float32, like every other thermometer: then the float64 sum over ranks is exact in any
        # order, and the collective reduction equals the driver's bit for bit (monitors.collective).
        tokens_per_s = float(np.float32(batch.inputs.numel() / dt))
        self.thermo.finish_args = (tokens_per_s,)
        self.thermo.end_step(loss=loss, lr=lr, grad_norm=norm)
        self._own.append((step, loss))
        self._seen.append((PROBE if self._probing else self.attempt, step, batch.sample_ids))
        self._held[step] = {
            "sample_lo": batch.sample_lo,
            "sample_hi": batch.sample_hi,
            "tokens": batch.tokens,
            "global_batch": batch.global_batch,
            "seq_len": batch.seq_len,
            "time_s": dt,
            "tokens_per_s": tokens_per_s,
            "lr_multiplier": multiplier,
            "lr_peak_ahead": self.schedule.peak_from(step) * multiplier,
            "ledger_digest": self._ledger_digest,
        }
        return self._take() if len(self.thermo.pending_steps) > (1 if self._read_late else 0) else None

    def drain(self) -> TrainedStep | None:
        """The step held back by `step()`, if any (before a checkpoint, a command, the end)."""
        return self._take()

    def probe_step(self, step: int, state: dict[str, Any]) -> TrainedStep | None:
        """A precise skip's probe step (trainer/probes.py): from data state `state` (the probe's
        ledger, its cursor), train `step` and hand out its own values at once (a probe is judged
        before the next one; nothing else is held back while probing)."""
        self.set_data_state(state)
        self._probing = True
        try:
            out = self.step(step)
        finally:
            self._probing = False
        return out if out is not None else self._take()

    def _take(self) -> TrainedStep | None:
        """The oldest ended step. Collective reduction: rank 0 hands out the
        reduced, packed vector (monitors.collective) and the other ranks None, so the driver
        receives one vector per step whatever the world size; driver reduction: every rank
        hands out its own values."""
        values = self.thermo.collect()  # the oldest ended step: its copy finished a step ago
        if values is None:
            return None
        held = self._held.pop(self.thermo.last_step)
        tokens_per_s = held.pop("tokens_per_s")
        if self._collective:
            if self.rank != 0:
                return None
        else:
            values = np.append(values, tokens_per_s)
        # loss: already on the host (reduced, if collective)
        return TrainedStep(step=self.thermo.last_step, values=values, loss=float(values[self._loss_slot]), **held)

    def own_losses(self, after_step: int) -> list[tuple[int, float]]:
        """This rank's own (step, loss) after `after_step` on the path trained since its data state
        was last set, before any reduction: which rank broke alone (replay triage's evidence, read
        once at a rollback: one copy from the device)."""
        import torch

        own = [(s, v) for s, v in self._own if s > after_step]
        if not own:
            return []
        values = torch.stack([v.float() for _, v in own]).cpu().tolist()
        return [(s, float(v)) for (s, _), v in zip(own, values)]

    def _forget_held(self) -> None:
        """A new data state abandons steps not handed out (the controller drains first)."""
        n = self.thermo.discard_pending() if self._engine is not None else 0
        if n:
            log.warning("rank %d: %d ended step(s) %s never collected were discarded", self.rank, n, sorted(self._held))
        self._held.clear()

    # --- state the controller sets ------------------------------------------------------------

    def data_state(self) -> dict[str, Any]:
        return self.loader.state.to_json()

    def set_data_state(self, state: dict[str, Any], attempt: int | None = None) -> None:
        from thermowatch.trainer.data import DataState

        self._forget_held()
        self._own.clear()  # a new path starts
        self.loader.load_state(DataState.from_json(state))
        self._note_ledger()
        if attempt is not None:
            self.attempt = attempt

    def skip(self, ranges: list[list[int]]) -> None:
        for lo, hi in ranges:
            self.loader.skip(int(lo), int(hi))
        self._note_ledger()

    def _note_ledger(self) -> None:
        # Hashed when the ledger changes, not per step.
        self._ledger_digest = ledger_digest(self.loader.state.ledger.ranges)

    def set_lr_changes(self, changes: list[LRChange]) -> None:
        self.lr_changes = list(changes)

    # --- checkpoints --------------------------------------------------------------------------

    def save(self, directory: str) -> dict[str, Any]:
        """Every rank writes its ZeRO shard into `directory` (shared by all ranks)."""
        self._engine.save(directory)
        return self.data_state()

    def load(self, directory: str) -> None:
        self._engine.load(directory)

    # --- for tests and the profiler -----------------------------------------------------------

    def pid(self) -> int:
        return os.getpid()

    def sample_ids_seen(self, attempt: int | None = None, after_step: int = 0) -> np.ndarray:
        """This rank's sample ids trained on (in `attempt`, if given) at steps > after_step."""
        ids = [s for a, st, s in self._seen if (attempt is None or a == attempt) and st > after_step]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)

    def profile(self, steps: int, out_dir: str) -> None:
        """Trace the next `steps` steps with torch.profiler into out_dir/rank<r>.json."""
        self._profile_left = int(steps)
        self._profile_dir = Path(out_dir)

    def _profile_tick(self) -> None:
        import torch

        if self._profiler is not None and self._profile_left <= 0:
            self._profiler.stop()
            self._profile_dir.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self._profile_dir / f"rank{self.rank}.json"))
            self._profiler = None
        if self._profile_left > 0:
            if self._profiler is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=acts, record_shapes=False)
                self._profiler.start()
            self._profile_left -= 1

    def flush_profile(self) -> bool:
        """Stop and write a trace still running (end of run). True if one was written."""
        if self._profiler is None:
            return False
        self._profile_left = 0
        self._profile_tick()
        return True

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._engine is not None:
            self.thermo.detach()
            self._engine = None
        if dist.is_initialized():
            dist.destroy_process_group()


class Gang:
    """All ranks of one attempt: a placement group, one TrainWorker actor per bundle, joined
    into one torch.distributed group. A gang is never repaired: after a failure the controller
    kills it and builds a new one (torch.distributed cannot re-admit a rank into a live group)."""

    def __init__(
        self,
        config: Any,  # TrainConfig
        attempt: int,
        data_state: dict[str, Any] | None,
        lr_changes: list[LRChange],
        ready_timeout_s: float = 600.0,
        exclude_nodes: list[str] = (),
        placement_timeout_s: float | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg, w = config, config.world_size
        bundle: dict[str, float] = {"CPU": cfg.cpus_per_rank}
        if cfg.use_gpu:
            bundle["GPU"] = 1
        # Excluded nodes (a bad node's Ray id) are kept out by a label selector on every bundle.
        selector = [{"ray.io/node-id": f"!in({','.join(exclude_nodes)})"}] * w if exclude_nodes else None
        self.pg = placement_group([dict(bundle) for _ in range(w)], strategy=cfg.placement,
                                  bundle_label_selector=selector)
        wait = cfg.placement_timeout_s if placement_timeout_s is None else placement_timeout_s
        try:
            ray.get(self.pg.ready(), timeout=wait)
        except Exception as exc:
            self._remove_pg()
            # A gang failure like a hung rank: the controller counts it as a restart and tries
            # again (capacity lost with a node may come back, an autoscaler may add some).
            raise PlacementTimeout(
                f"Ray could not place {w} ranks of {bundle} with strategy {cfg.placement}"
                f"{' outside excluded node(s) ' + ', '.join(exclude_nodes) if exclude_nodes else ''} within "
                f"{wait:.0f}s ({type(exc).__name__}); add nodes, lower world_size / cpus_per_rank, or use "
                "placement=PACK on one node"
            ) from exc
        self.workers: list = []
        try:
            self._bring_up(cfg, attempt, data_state, lr_changes, ready_timeout_s)
        except BaseException:
            self.kill()  # no half-built gang holding actors and a placement group
            raise

    def _bring_up(
        self, cfg: Any, attempt: int, data_state: dict[str, Any] | None, lr_changes: list[LRChange], timeout_s: float
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        w = cfg.world_size
        env = {"DS_ACCELERATOR": "cuda" if cfg.use_gpu else "cpu"}
        actor = ray.remote(TrainWorker)
        self.workers = [
            actor.options(
                num_cpus=cfg.cpus_per_rank,
                num_gpus=1 if cfg.use_gpu else 0,
                max_restarts=0,  # a dead rank means a new gang, never a lone restarted actor
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": env},
            ).remote(r, w)
            for r in range(w)
        ]
        addresses = gather([a.address.remote() for a in self.workers], timeout_s)
        master_addr, master_port, _ = addresses[0]
        self.hosts = {r: ip for r, (ip, _, _) in enumerate(addresses)}
        self.node_ids = {r: node for r, (_, _, node) in enumerate(addresses)}
        # LOCAL_RANK = index among the ranks on the same node. On GPUs Ray gives each actor one
        # visible device, which torch then calls cuda:0, so the local rank there is 0.
        per_node: dict[str, int] = {}
        local = []
        for ip, _, _ in addresses:
            local.append(per_node.get(ip, 0))
            per_node[ip] = per_node.get(ip, 0) + 1
        # gather, not ray.get: a rank that dies here leaves the others waiting in the rendezvous.
        infos = gather(
            [
                a.setup.remote(
                    cfg.to_dict(),
                    attempt,
                    data_state,
                    lr_changes,
                    master_addr,
                    master_port,
                    0 if cfg.use_gpu else local[r],
                    1 if cfg.use_gpu else per_node[addresses[r][0]],
                )
                for r, a in enumerate(self.workers)
            ],
            timeout_s,
        )
        self.names: list[str] = infos[0].names
        self.flops_per_token: int = infos[0].flops_per_token

    def submit(self, method: str, *args: Any) -> list:
        """Call `method` on every rank; returns the object refs (ranks run collectives together)."""
        return [getattr(a, method).remote(*args) for a in self.workers]

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        return gather(self.submit(method, *args), timeout_s)

    def kill(self) -> None:
        import ray

        for a in self.workers:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead: that is why we are here
                pass
        self.workers = []
        self._remove_pg()

    def _remove_pg(self) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


class GangTimeout(RuntimeError):
    """Ranks that neither answered nor died in time (a hung collective, a stalled node)."""


class PlacementTimeout(GangTimeout):
    """Ray could not place the gang's ranks in time: not enough capacity (a node was lost, or
    excluded), or a strategy the cluster cannot satisfy."""


class PeerLost(RuntimeError):
    """A rank's collective failed because a peer went away (a lost node: the survivors' gloo
    or NCCL connections break before Ray reports the dead actors). The gang is broken."""


def _collective_failure(cause: BaseException | None) -> bool:
    import torch.distributed as dist

    # NCCL and newer gloo paths raise DistError subclasses; gloo's TCP transport raises a plain
    # RuntimeError that names its source file (".../gloo/transport/tcp/pair.cc").
    return isinstance(cause, dist.DistError) or (isinstance(cause, RuntimeError) and "gloo/transport" in str(cause))


def gather(refs: list, timeout_s: float | None = None) -> list:
    """ray.get of all ranks' results, but raising as soon as *any* rank fails: a plain
    ray.get(list) would block on a live rank stuck in a collective waiting for the dead one."""
    import ray

    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise GangTimeout(f"{len(pending)} rank(s) did not answer within {timeout_s}s")
        try:
            ray.get(ready)  # raises RayActorError / RayTaskError for a failed rank
        except ray.exceptions.RayTaskError as exc:
            if _collective_failure(exc.cause):
                raise PeerLost(f"rank {refs.index(ready[0])}'s collective failed, a peer is gone: {exc.cause}") from exc
            raise
    return ray.get(list(refs))
