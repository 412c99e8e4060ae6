"""The checkpoint store: atomic commit, manifest, corruption checks, retention.

Engine-agnostic: the caller's `write_fn(dir)` writes whatever it wants (DeepSpeed writes its
ZeRO shards); the store makes the result a checkpoint. Layout under `root`:

    step_00001200.tmp/        being written (never read as a checkpoint)
    step_00001200/            committed: holds manifest.json, written last
        manifest.json         step, data state (cursor, tokens, skip ledger), lr, attempt,
                              wall time, healthy flag, every file with its size and checksum
    step_00000800.deleting/   being removed by retention (never read as a checkpoint)
    index.json                retention bookkeeping, written before anything is deleted

Commit order: files written -> each file fsynced -> manifest.json written + fsynced -> dir
fsynced -> staging dir renamed to its final name (atomic) -> root fsynced. A crash at any
point leaves either a `.tmp` dir or a complete checkpoint; a torn or bit-flipped file in a
committed one is caught by the size/checksum listing and `latest_valid` passes over it.

Rollback needs a healthy checkpoint *before* a spike's onset (PaLM restarted ~100 steps
before; YaLM-100B rolled back thousands of steps, "roll back to 13k"), so retention keeps the
last K plus one per M-step span, the newest valid and the newest healthy one
(monitors/retention.py's rule, shared with thermowatch.watch, which also keeps the newest one at
least 110 steps old).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from thermowatch.monitors.contract import CheckpointInfo
from thermowatch.monitors.durable import fsync_dir, write_json_atomic
from thermowatch.monitors.manifest import MANIFEST, file_digest, files_problem  # noqa: F401 - file_digest is this module's API too
from thermowatch.monitors.retention import BEHIND, retained

log = logging.getLogger(__name__)

FORMAT = 1
STAGING_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
_DIR_RE = re.compile(r"^step_(\d{8,})$")
_RESERVED = ("format", "step", "files", "checksum", "wall_time")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or read. The message says which and why."""


@dataclass(frozen=True)
class Retention:
    keep_last: int = 3  # the newest few: a PaLM-style restart ~100 steps back usually lands here
    # One checkpoint per `keep_every`-step span lives forever, so an onset found late (or a slow
    # drift, YaLM's "roll back to 13k") still has a target behind it. 0 keeps no such anchors.
    keep_every: int = 1000
    # Every checkpoint of the last `keep_behind` steps (a tenth of it apart at most), and older
    # ones thinning with their age: the rule in steps, not a count, so the target of a rollback
    # asked for now stays whatever keep_last is (monitors/retention.py; issue 35). 0 = off.
    keep_behind: int = BEHIND
    # "edges": size + crc32 of the first and last 1 MiB (whole file when <= 2 MiB). Catches
    # truncation and torn tails, the usual failures (node died mid-write, disk full), while
    # scanning many multi-GB ZeRO shards stays fast. "full": crc32 of every byte (catches
    # mid-file bit rot; costs one full read of every checkpoint per validation).
    checksum: str = "edges"

    def __post_init__(self) -> None:
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(
                f"Retention.keep_last must be an integer >= 1, got {self.keep_last!r}: the newest "
                "checkpoint is the resume point and is always kept"
            )
        for name in ("keep_every", "keep_behind"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Retention.{name} must be an integer >= 0 (0 = off), got {v!r}")
        if self.checksum not in ("edges", "full"):
            raise ValueError(f"Retention.checksum must be 'edges' or 'full', got {self.checksum!r}")


class CheckpointStorage(Protocol):
    """The seam the run controller (and its command handlers, trainer.obey) are typed against:
    every call they make on their checkpoints. `CheckpointStore` below is the filesystem
    implementation, the one the tests use too (on a tmp dir, a tmpfs that fills up)."""

    root: Path  # the run's checkpoint root (attempt.json, commands.json, the sink's spool)
    on_deleted: Callable[[list[int]], None] | None  # told of each retention delete

    def clean_staging(self) -> list[Path]: ...

    def begin(self, step: int) -> Path: ...

    def commit(self, step: int, manifest: Mapping[str, Any]) -> CheckpointInfo: ...

    def discard(self, step: int) -> None: ...

    def steps(self) -> list[int]: ...

    def problem(self, step: int) -> str | None: ...

    def latest_valid(self, max_step: int | None = None, healthy_only: bool = False) -> CheckpointInfo | None: ...

    def load_manifest(self, step: int) -> dict[str, Any]: ...

    def abandon_after(self, step: int, reason: str = "") -> list[int]: ...

def make_manifest(
    data_state: Mapping[str, Any] | Any,
    *,
    lr_multiplier: float = 1.0,
    lr_changes: list[Mapping[str, Any]] | None = None,
    attempt: int = 0,
    healthy: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """The caller's part of a manifest. `data_state` is a DataState or its `to_json()` dict;
    `lr_changes` lists {"step", "multiplier", ...} entries (DESIGN.md: an LR change is a
    multiplier recorded with the step it starts at)."""
    data = data_state.to_json() if hasattr(data_state, "to_json") else dict(data_state)
    return {
        "data": data,
        "lr": {"multiplier": float(lr_multiplier), "changes": list(lr_changes or [])},
        "attempt": int(attempt),
        "healthy": bool(healthy),
        **extra,
    }


class CheckpointStore:
    """Checkpoints of one run under `root` (a local or shared filesystem)."""

    def __init__(self, root: str | os.PathLike[str], retention: Retention | None = None) -> None:
        self.root = Path(root)
        self.retention = retention or Retention()
        # Called with the steps retention deleted, right after it deleted them (the run
        # controller tells the supervisor, so its list never offers a gone checkpoint).
        self.on_deleted: Callable[[list[int]], None] | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._finish_deletes()

    # --- paths --------------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def staging_dir(self, step: int) -> Path:
        """Where `step`'s files are written before commit; every rank may write here."""
        return self.root / f"step_{step:08d}{STAGING_SUFFIX}"

    # --- save ---------------------------------------------------------------------------------

    def save(self, step: int, write_fn: Callable[[Path], None], manifest: Mapping[str, Any]) -> CheckpointInfo:
        """begin() + write_fn(staging dir) + commit(): the one-process form."""
        staging = self.begin(step)
        try:
            write_fn(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self.commit(step, manifest)

    def begin(self, step: int) -> Path:
        """Create an empty staging dir for `step` (a leftover one from a crash is removed).
        Multi-rank engines: rank 0 calls begin, all ranks write, then rank 0 calls commit."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
        staging = self.staging_dir(step)
        if staging.exists():
            log.warning("removing leftover staging dir %s (a save that never committed)", staging)
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        return staging

    def discard(self, step: int) -> None:
        """Remove `step`'s staging dir: a save that failed, so its files free the space again."""
        shutil.rmtree(self.staging_dir(step), ignore_errors=True)

    def commit(self, step: int, manifest: Mapping[str, Any]) -> CheckpointInfo:
        """Checksum the staged files, write the manifest last, rename into place, apply retention."""
        staging = self.staging_dir(step)
        if not staging.is_dir():
            raise CheckpointError(f"nothing staged for step {step} at {staging}; call begin({step}) first")
        body = self._check_manifest(step, manifest)
        files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST)
        listing: dict[str, Any] = {}
        for p in files:
            _fsync_file(p)  # data must be durable before the manifest vouches for it
            listing[p.relative_to(staging).as_posix()] = file_digest(p, self.retention.checksum)
        body.update(
            format=FORMAT, step=step, wall_time=time.time(), checksum=self.retention.checksum, files=listing
        )
        write_json_atomic(staging / MANIFEST, body)
        final = self.path(step)
        trash = None
        if final.exists():
            # Same step saved again, e.g. after a rollback replayed it on a new trajectory: the
            # new one wins. Move the old one aside first so the final name is never half-old.
            trash = final.with_name(f"{final.name}.{time.time_ns()}{DELETING_SUFFIX}")
            os.replace(final, trash)
        os.replace(staging, final)
        fsync_dir(self.root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        info = self._info(step, body)
        log.info("checkpoint step %d committed at %s (%d files)", step, final, len(listing))
        self.prune()
        return info

    def _check_manifest(self, step: int, manifest: Mapping[str, Any]) -> dict[str, Any]:
        body = json.loads(json.dumps(dict(manifest)))  # a deep copy, and proof it is JSON
        data = body.get("data")
        if not isinstance(data, dict) or "cursor" not in data or "tokens_consumed" not in data:
            raise CheckpointError(
                f"step {step}: manifest['data'] must be the data state (cursor, tokens_consumed, "
                f"skip_ranges), got {data!r}; build the manifest with make_manifest(loader.state)"
            )
        clash = [k for k in _RESERVED if k in body and not (k == "step" and body[k] == step)]
        if clash:
            raise CheckpointError(f"step {step}: manifest keys {clash} are written by the store; remove them")
        body.setdefault("healthy", True)
        body.setdefault("attempt", 0)
        body.setdefault("lr", {"multiplier": 1.0, "changes": []})
        return body

    # --- read ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of committed-looking dirs (final names), ascending, without validation."""
        out = []
        for p in self.root.iterdir():
            m = _DIR_RE.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def load_manifest(self, step: int) -> dict[str, Any]:
        path = self.path(step) / MANIFEST
        try:
            body = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"step {step}: no {path} (not saved, deleted, or never committed)") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"step {step}: {path} is unreadable: {exc}") from exc
        if not isinstance(body, dict) or body.get("step") != step:
            raise CheckpointError(f"step {step}: {path} describes step {body.get('step') if isinstance(body, dict) else body!r}")
        return body

    def problem(self, step: int) -> str | None:
        """Why checkpoint `step` cannot be used, or None if it is complete and intact."""
        try:
            body = self.load_manifest(step)
        except CheckpointError as exc:
            return str(exc)
        try:
            why = files_problem(self.path(step), body)
            if why:
                return f"step {step}: {why}"
            int(body["data"]["cursor"])
        except (KeyError, TypeError, AttributeError, ValueError, OSError) as exc:
            return f"step {step}: manifest or files unusable ({type(exc).__name__}: {exc})"
        return None

    def list(self, validate: bool = True) -> list[CheckpointInfo]:
        """Committed checkpoints, ascending; with validate, corrupt ones are left out (logged)."""
        out = []
        for step in self.steps():
            why = self.problem(step) if validate else None
            if why:
                log.warning("passing over checkpoint: %s", why)
                continue
            try:
                out.append(self._info(step, self.load_manifest(step)))
            except CheckpointError as exc:
                log.warning("passing over checkpoint: %s", exc)
        return out

    def latest_valid(self, max_step: int | None = None, healthy_only: bool = False) -> CheckpointInfo | None:
        """The newest intact checkpoint with step <= max_step (and healthy when saved, if asked).
        Validates newest-first and stops at the first good one."""
        for step in reversed(self.steps()):
            if max_step is not None and step > max_step:
                continue
            why = self.problem(step)
            if why:
                log.warning("passing over checkpoint: %s", why)
                continue
            body = self.load_manifest(step)
            if healthy_only and not body.get("healthy", False):
                # Expected after every rollback, and asked again at every save: debug, or `train`
                # prints the same abandoned steps after each checkpoint for the rest of the run.
                log.debug("passing over checkpoint step %d: marked unhealthy (%s)", step, body.get("unhealthy_reason", ""))
                continue
            return self._info(step, body)
        return None

    def _info(self, step: int, body: Mapping[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(
            step=step,
            path=str(self.path(step)),
            sample_cursor=int(body["data"]["cursor"]),
            healthy=bool(body.get("healthy", False)),
            manifest=dict(body),
        )

    # --- health -------------------------------------------------------------------------------

    def mark_unhealthy(self, step: int, reason: str = "") -> None:
        """Record that the run was not healthy at `step` (e.g. a spike's onset came before it).
        The manifest is rewritten atomically; the file listing, hence validity, is unchanged."""
        body = self.load_manifest(step)
        body["healthy"] = False
        body["unhealthy_reason"] = reason
        body["marked_unhealthy_at"] = time.time()
        write_json_atomic(self.path(step) / MANIFEST, body)
        log.info("checkpoint step %d marked unhealthy: %s", step, reason)

    def abandon_after(self, step: int, reason: str = "") -> list[int]:
        """Mark every checkpoint after `step` unhealthy (the trajectory a rollback left), so a
        relaunch with healthy_only never resumes from it. Kept on disk for forensics."""
        marked = []
        for s in self.steps():
            if s > step:
                try:
                    self.mark_unhealthy(s, reason or f"abandoned by rollback to step {step}")
                    marked.append(s)
                except CheckpointError as exc:
                    log.warning("could not mark step %d unhealthy: %s", s, exc)
        return marked

    # --- retention ----------------------------------------------------------------------------

    def retained(self, steps: list[int]) -> set[int]:
        """Which of `steps` the retention rule keeps (before the newest-valid/healthy guards):
        monitors/retention.py, the client's rule too."""
        # In steps back from the newest, whatever keep_last is (issue 35): a rollback's target stays.
        return retained(steps, self.retention.keep_last, self.retention.keep_every,
                        now=steps[-1] if steps else None, behind=self.retention.keep_behind)

    def prune(self) -> list[int]:
        """Delete what retention does not keep; returns the deleted steps."""
        steps = self.steps()
        keep = self.retained(steps)
        for guard in (self.latest_valid(), self.latest_valid(healthy_only=True)):
            if guard is not None:
                keep.add(guard.step)
        doomed = [s for s in steps if s not in keep]
        if not doomed:
            return []
        # Crash ordering (as Ray Train's checkpoint manager): bookkeeping first, then deletes.
        # A crash after the index is written but before a delete leaves an extra checkpoint
        # (harmless, pruned next time); the reverse order could leave an index naming deleted
        # checkpoints. Each doomed dir is renamed to *.deleting first (atomic), so a crash
        # mid-rmtree never leaves a half-deleted dir under a checkpoint's name.
        write_json_atomic(
            self.root / "index.json",
            {"retained": sorted(keep & set(steps)), "deleting": doomed, "retention": vars(self.retention), "time": time.time()},
        )
        for s in doomed:
            gone = self.path(s).with_name(f"step_{s:08d}{DELETING_SUFFIX}")
            os.replace(self.path(s), gone)
            shutil.rmtree(gone, ignore_errors=True)
            log.info("retention deleted checkpoint step %d", s)
        fsync_dir(self.root)
        if self.on_deleted is not None:
            self.on_deleted(doomed)
        return doomed

    def clean_staging(self) -> list[Path]:
        """Remove `.tmp` dirs left by saves that never committed. Call it when no save is
        running (e.g. at the start of an attempt, on rank 0)."""
        stale = [p for p in self.root.iterdir() if p.is_dir() and p.name.endswith(STAGING_SUFFIX)]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return stale

    def _finish_deletes(self) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and p.name.endswith(DELETING_SUFFIX):
                shutil.rmtree(p, ignore_errors=True)


# --- durability helpers -----------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
