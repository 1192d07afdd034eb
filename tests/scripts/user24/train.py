"""python train.py KIND [--mode raise|warn|log] [--defer] [--dump DIR] [--plain]

KIND: forward, loss, backward, optimizer, data, clean. --plain: no watch (for `python -m nan_magic run`).
"""
import argparse
import sys

import torch
import trainlib

import nan_magic

parser = argparse.ArgumentParser()
parser.add_argument("kind")
parser.add_argument("--mode", default="raise")
parser.add_argument("--defer", action="store_true")
parser.add_argument("--dump", default=None)
parser.add_argument("--plain", action="store_true")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

torch.manual_seed(0)
model = trainlib.Net(bad_forward=args.kind == "forward")
lr = float("inf") if args.kind == "optimizer" else 1e-2
opt = torch.optim.SGD(model.parameters(), lr=lr)
bad_data = 2 if args.kind == "data" else None
if args.plain:
    losses = trainlib.train(model, opt, args.steps, args.kind, bad_data)
    print("losses", losses)
    sys.exit(0)



def where(report):
    """One line a log can be grepped for: what the report names."""
    source = report.source and (report.source.filename.rsplit("/", 1)[-1], report.source.lineno)
    return f"REPORT {report.phase} {report.module!r} {report.op} {source} step {report.step}"


options = dict(on_detect=args.mode, defer=args.defer, dump=args.dump)
try:
    with nan_magic.watch(model, opt, **options) as w:
        losses = trainlib.train(model, opt, args.steps, args.kind, bad_data)
except nan_magic.NonFiniteError as error:
    print("CAUGHT", type(error).__name__)
    print(where(error.report))
    sys.exit(1)
print("losses", losses)
print("EVENTS", len(w.events))
for event in w.events:
    print("EVENT", where(event), event.benign)
if w.report is not None:
    print(where(w.report))
sys.exit(0 if w.report is None else 1)
