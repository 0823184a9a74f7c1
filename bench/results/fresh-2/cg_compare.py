"""Self cost by function of two callgrind dumps, per request: python cg_compare.py A B EVENT N."""

import collections
import re
import sys


def parse(path):
    names = {"fn": {}, "ob": {}, "fl": {}}
    cost = collections.defaultdict(lambda: [0] * 13)
    fn = ob = None
    skip = False
    events = None
    with open(path) as f:
        text = f.read().splitlines()
    for line in text:
        line = line.rstrip("\n")
        if line.startswith("events:"):
            events = line.split()[1:]
            continue
        m = re.match(r"^(fn|ob|fl|fi|fe|cfn|cob|cfi|cfl)=\((\d+)\)(?: (.*))?$", line)
        if m:
            kind, idx, name = m.groups()
            base = {"cfn": "fn", "cob": "ob", "cfi": "fl", "cfl": "fl", "fi": "fl", "fe": "fl"}.get(
                kind, kind
            )
            if name:
                names[base][idx] = name
            if kind == "fn":
                fn = names["fn"].get(idx, idx)
            if kind == "ob":
                ob = names["ob"].get(idx, idx)
            continue
        if line.startswith("calls="):
            skip = True
            continue
        if line and (line[0].isdigit() or line[0] in "+-*"):
            if skip:
                skip = False
                continue
            parts = line.split()[1:]
            c = cost[(ob.split("/")[-1] if ob else "?", fn)]
            for i, v in enumerate(parts):
                c[i] += int(v)
    return events, cost


ev, a = parse(sys.argv[1])
_, b = parse(sys.argv[2])
k = ev.index(sys.argv[3]) if len(sys.argv) > 3 else ev.index("Bcm")
n = float(sys.argv[4]) if len(sys.argv) > 4 else 3000
keys = set(a) | set(b)
rows = sorted(keys, key=lambda x: -abs(a.get(x, [0] * 13)[k] - b.get(x, [0] * 13)[k]))
print("events", ev[k], "per request: main base diff  (Ir main base)")
for x in rows[:40]:
    va, vb = a.get(x, [0] * 13), b.get(x, [0] * 13)
    print(
        f"{va[k] / n:10.1f} {vb[k] / n:10.1f} {(va[k] - vb[k]) / n:+10.1f}   "
        f"Ir {va[0] / n:9.1f} {vb[0] / n:9.1f}  {x[0]}:{x[1]}"
    )
print("total", sum(v[k] for v in a.values()) / n, sum(v[k] for v in b.values()) / n)
