"""Are two exports of the same checkpoint the same graphs? Node for node, weight byte for byte.

A refactor of the exporter must not change what it writes. Export the same tiny pair with
the code before and after, then compare:

    python tools/same_export.py pairs ROOT                     # tiny pairs (fixed seeds) under ROOT/<name>/{t,d}
    dflash-export export --target ROOT/dense/t --draft ROOT/dense/d --out A/dense   # with each version
    python tools/same_export.py compare A/dense B/dense

`compare` loads every graph of both manifests with its external data and checks that the
node lists are equal (each NodeProto serialized: op, domain, inputs, outputs, attributes, in
order), the graph inputs/outputs are equal, and every initializer (by name) has the same
dtype, shape and bytes. Exit 1 with the first differences, else one line per graph.
Needs the export extra (torch for `pairs`, onnx for `compare`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import onnx
from onnx import numpy_helper

from dflash_export.runtime import contract as C, manifest as M

PAIRS = {  # name -> make_target keywords: a dense target, a tied one, and one whose experts stream at export
    "dense": dict(arch="qwen3"),
    "tied": dict(arch="llama", tie=True),
    "moe": dict(arch="qwen3_moe", layers=2, hidden=32, vocab=64),
}


def make_pairs(root: Path) -> None:
    from dflash_export.models.tiny import make_drafter, make_target  # torch: only for `pairs` (compare needs onnx alone)

    for name, kw in PAIRS.items():
        t = make_target(root / name / "t", seed=1, **kw)
        make_drafter(root / name / "d", t, seed=2)
        print(f"{root / name}: t, d")


def graph(directory: Path, name: str) -> onnx.GraphProto:
    return onnx.load(str(directory / C.GRAPH_FILES[name]), load_external_data=True).graph


def differences(a: onnx.GraphProto, b: onnx.GraphProto) -> list[str]:
    out = []
    na, nb = [n.SerializeToString() for n in a.node], [n.SerializeToString() for n in b.node]
    if na != nb:
        i = next((i for i, (x, y) in enumerate(zip(na, nb)) if x != y), min(len(na), len(nb)))
        out.append(f"nodes differ: {len(na)} vs {len(nb)}, first at {i}")
    for what in ("input", "output"):
        if [v.SerializeToString() for v in getattr(a, what)] != [v.SerializeToString() for v in getattr(b, what)]:
            out.append(f"graph {what}s differ")
    ia, ib = {t.name: t for t in a.initializer}, {t.name: t for t in b.initializer}
    if set(ia) != set(ib):
        out.append(f"initializer names differ: only A {sorted(set(ia) - set(ib))[:5]}, only B {sorted(set(ib) - set(ia))[:5]}")
    for k in sorted(set(ia) & set(ib)):
        x, y = numpy_helper.to_array(ia[k]), numpy_helper.to_array(ib[k])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            out.append(f"initializer {k} differs")
    return out


def compare(a: Path, b: Path) -> int:
    ma, mb = M.load_manifest(a, verify=False), M.load_manifest(b, verify=False)
    if sorted(ma.graphs) != sorted(mb.graphs):
        print(f"different graphs: {sorted(ma.graphs)} vs {sorted(mb.graphs)}")
        return 1
    bad = 0
    for name in sorted(ma.graphs):
        ga, gb = graph(a, name), graph(b, name)
        diff = differences(ga, gb)
        bad += bool(diff)
        print(f"{name}: " + ("; ".join(diff[:5]) if diff else
                             f"{len(ga.node)} nodes identical, {len(ga.initializer)} initializers byte-identical"))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("pairs").add_argument("root", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "pairs":
        make_pairs(args.root)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
