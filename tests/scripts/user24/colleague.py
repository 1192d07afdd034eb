"""A colleague opens a scene file a training run left: python colleague.py SCENE"""
import sys

import torch
import trainlib

import nan_magic

path = sys.argv[1]
raw = torch.load(path, weights_only=True)  # what a colleague who trusts no pickle does first
print("KEYS", len(raw))

scene = nan_magic.load_scene(path)
r = scene.report
print("SCENE", r.phase, repr(r.module), r.op, r.step, r.source and r.source.lineno, r.nan, r.posinf, r.neginf)
model = trainlib.Net(bad_forward=r.module == "head")
opt = torch.optim.SGD(model.parameters(), lr=float("inf") if r.phase == "optimizer" else 1e-2)
scene.restore_into(model, opt)
if r.phase == "forward" and r.module is not None:
    result = scene.replay(model)
    print("REPLAY", result.reproduced, result.finding.op, result.finding.nan)
else:
    print("BATCH", type(scene.batch).__name__)
