"""Comparable runs (issue 24, item 1): the runs of the same model config, and each one's loss and
LR by step, read for monitors/envelope.py. One read model for the `peer_envelope` job (which
judges) and the run page's loss chart (which draws the envelope it was judged against).

Comparable = the same `model` section of the run's config (the bundled trainer's GPTConfig;
`thermowatch.watch` writes a fingerprint of the module tree there): canonical JSON. Candidates are
the newest PEER_RUNS runs, whatever the database holds (an ingest token can make 10^5 runs).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import LOSS, LR
from thermowatch.monitors.envelope import Curve
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import thermometers as thermo_store

PEER_RUNS = 200


def model_key(config: dict[str, Any] | None) -> str | None:
    """What makes runs comparable: the `model` section of the run's config, canonical JSON; None
    (never compared) for a run that does not say."""
    model = (config or {}).get("model")
    return json.dumps(model, sort_keys=True, default=str) if isinstance(model, dict) and model else None


def curve(s: Session, run_id: str) -> Curve:
    """The run's loss and LR by step, the newest value of a step re-trained after a rollback."""
    def newest(key: str) -> tuple[np.ndarray, np.ndarray]:
        steps, values = thermo_store.history(s, run_id, key)
        uniq, idx = np.unique(steps[::-1], return_index=True)
        return uniq, values[::-1][idx]
    steps, loss = newest(LOSS)
    lr_steps, lr = newest(LR)
    lr_at = np.full(len(steps), np.nan)
    if len(lr_steps):
        at = np.minimum(np.searchsorted(lr_steps, steps), len(lr_steps) - 1)
        lr_at = np.where(lr_steps[at] == steps, lr[at], np.nan)
    return Curve(run_id, steps, loss, lr_at)


def model_keys(s: Session, run_ids: list[str]) -> dict[str, str | None]:
    out = {}
    for rid in run_ids:
        row = runs_store.get_run(s, rid)
        out[rid] = model_key(row.config) if row is not None else None
    return out


def comparable(keys: dict[str, str | None], run_id: str) -> list[str]:
    """The runs among `keys` with `run_id`'s model key, itself left out; none when it has no key."""
    key = keys.get(run_id)
    return [p for p, k in keys.items() if key is not None and k == key and p != run_id]


def peers_of(s: Session, run_id: str) -> list[str]:
    """`run_id`'s comparable runs among the newest PEER_RUNS (it need not be among them)."""
    newest = runs_store.newest_run_ids(s, PEER_RUNS)
    keys = model_keys(s, list(dict.fromkeys([run_id, *newest])))
    return comparable(keys, run_id)


def envelope_view(s: Session, run_id: str, cfg: Any = None, points: int = 2000) -> dict[str, Any]:
    """What the run page draws on its loss chart: the envelope of the comparable runs at each of
    the run's steps (null where none had trained with no more LR yet), the band `gap_nats` above
    it (being above the band for `confirm` steps pages), and the peers by name. At most `points`
    points: the envelope is a trailing mean already, every k-th step draws it."""
    from thermowatch.monitors.envelope import EnvelopeConfig, envelope

    cfg = cfg or EnvelopeConfig()
    out: dict[str, Any] = {"run_id": run_id, "peers": [], "gap_nats": cfg.gap_nats, "start": cfg.start,
                           "confirm": cfg.confirm, "steps": [], "envelope": [], "peer": []}
    peers = peers_of(s, run_id)
    if not peers:
        return out
    run = curve(s, run_id)
    env = envelope(run, [curve(s, p) for p in peers], cfg)
    keep = np.arange(0, len(run.steps), max(1, -(-len(run.steps) // points)))
    best = env.best[keep]
    ok = np.isfinite(best)
    out.update(peers=peers, steps=run.steps[keep][ok].tolist(), envelope=best[ok].tolist(),
               peer=env.who[keep][ok].tolist())
    return out
