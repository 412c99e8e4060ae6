"""Runs of a user's own loop are comparable runs for the peer envelope (issue 24, item 1):
thermowatch.watch writes the model's fingerprint as the run's `model` config section."""

from __future__ import annotations

import torch

import thermowatch
from tests.client.user_loop import DATA, train_step, user_batch, user_model
from thermowatch.loop import model_fingerprint
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import peers as peers_store


def test_the_same_architecture_is_comparable_and_another_is_not(tmp_path):
    a, b, wide = user_model(), user_model(), user_model(d=64)
    with torch.no_grad():
        next(b.parameters()).mul_(2.0)  # other weights: the same architecture
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(wide)
    assert model_fingerprint(a)["parameters"] == sum(p.numel() for p in a.parameters())

    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=f"sqlite:///{tmp_path}/db.sqlite")
    sup = None
    for name, model, extra in (("a", a, None), ("b", b, None), ("wide", wide, None),
                               ("own", user_model(), {"model": {"name": "mine"}})):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tw = thermowatch.watch(model, opt, run=name, steps=2, global_batch=4, checkpoint_dir=tmp_path / name,
                               supervisor_config=cfg, config=extra, thermometers=False)
        for step in tw.steps():
            tw.record(train_step(model, opt, *user_batch(DATA, tw.batch_ids(step))))
        tw.run.flush()
        if name == "own":
            sup = tw.run.supervisor
            with sup.sessions() as s:
                assert peers_store.peers_of(s, "a") == ["b"] and peers_store.peers_of(s, "wide") == []
                assert peers_store.peers_of(s, "own") == []  # the user's own model section is kept
        tw.close()
