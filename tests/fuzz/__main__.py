"""``python -m fuzz --seeds 0:300 --out verdicts.jsonl`` (from ``tests/``): run a batch, print the classes."""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from fuzz.run import judge


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fuzz")
    parser.add_argument("--seeds", default="0:50", help="start:stop")
    parser.add_argument("--out", default=None, help="append one JSON line per incident")
    parser.add_argument("--keep", default=None, help="directory to keep the generated files in")
    parser.add_argument("--no-twin", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start, stop = (int(n) for n in args.seeds.split(":"))
    directory = Path(args.keep or tempfile.mkdtemp(prefix="fuzz_"))
    directory.mkdir(parents=True, exist_ok=True)
    classes: collections.Counter[str] = collections.Counter()
    for seed in range(start, stop):
        began = time.perf_counter()
        verdict = judge(seed, directory, twin=not args.no_twin)
        labels = verdict.classes()
        classes.update(labels)
        print(f"{seed} {verdict.truth.key()} {time.perf_counter() - began:.1f}s {len(labels)} wrong", flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps({"truth": asdict(verdict.truth), "wrong": verdict.wrong,
                                      "said": {m: [str(v) for v in said] for m, said in verdict.said.items()},
                                      "twin": verdict.twin}) + "\n")
    for label, count in classes.most_common():
        print(f"{count:4d}  {label}")


if __name__ == "__main__":
    main()
