"""In process, CPU µs per fresh 512-token prompt of three nested steps, for the tree on PYTHONPATH
(today's API, or d21257b's: `wire_key`, `choose_known`, `choose(key, replicas, wire)`):

- body: the prompt's ids parsed and packed (`_range_checked`; d21257b: `array(orjson.loads)`);
- +key: and its keys built (wire key, block key and its chain);
- +route: and routed as the proxy does it, load accounting included, 2 replicas.

    PYTHONPATH=. taskset -c 0 python bench/results/fresh-2/policy_cost.py
    PYTHONPATH=/tmp/base-d21257b taskset -c 0 python bench/results/fresh-2/policy_cost.py

Each figure is the fastest of 3 passes over 20,000 new prompts, after 2,000; the policy's part
of a fresh prompt is +route less +key. On today's API, `REPLICAS=n` routes among n replicas
and `WALK_DEAL_MEMBERS=k` sets the fleet size up to which the policy deals by a ring walk (0:
always from the kept ranks), to compare the two deals.
"""

import os
import time
from array import array

import orjson

import lora_router.routing.policy as policy

M = 20000
FIXED = [(i * 7919) % 151_000 for i in range(3, 512)]


def raw_of(n: int) -> bytes:
    return ("[" + ", ".join(map(str, [7, n % 100000, n // 100000, *FIXED])) + "]").encode()


class Rep:
    __slots__ = ("in_flight", "in_flight_tokens", "name")

    def __init__(self, name: str) -> None:
        self.name, self.in_flight, self.in_flight_tokens = name, 0, 0


reps = [Rep(f"http://127.0.0.1:{i + 1}") for i in range(int(os.environ.get("REPLICAS", "2")))]
today = hasattr(policy, "Candidates")
if today:
    if "WALK_DEAL_MEMBERS" in os.environ:
        policy.WALK_DEAL_MEMBERS = int(os.environ["WALK_DEAL_MEMBERS"])
    from lora_router.proxy.body import Completion, _range_checked
    from lora_router.routing.keys import Lineages, completion_key

    pol = policy.PrefixAffinity()
    pol.set_members(reps)
    cands = policy.Candidates(reps)
    seeds = Lineages().seeds(None, False)

    def body(raw: bytes) -> object:
        return Completion(None, raw, _range_checked(raw), None, False)

    def key(raw: bytes) -> object:
        made = completion_key(Completion(None, raw, _range_checked(raw), None, False), seeds, 16)
        return made.key.chain

    def route(raw: bytes) -> None:
        made = completion_key(Completion(None, raw, _range_checked(raw), None, False), seeds, 16)
        d = pol.choose(made, cands)
        r = d.replica
        r.in_flight += 1
        r.in_flight_tokens += d.tokens
        cands.in_flight += 1
        pol.load_changed(r)
        r.in_flight -= 1
        r.in_flight_tokens -= d.tokens
        cands.in_flight -= 1
        pol.load_changed(r)
else:
    from lora_router.routing.keys import prompt_key, wire_key

    pol = policy.PrefixAffinity()
    pol.set_members([r.name for r in reps])

    def body(raw: bytes) -> object:
        return array("I", orjson.loads(raw))

    def key(raw: bytes) -> object:
        return wire_key(None, raw), prompt_key(None, array("I", orjson.loads(raw)), 16).chain

    def route(raw: bytes) -> None:
        tokens = array("I", orjson.loads(raw))
        wire = wire_key(None, raw)
        d = pol.choose_known(wire, reps)
        if d is None:
            d = pol.choose(prompt_key(None, tokens, 16), reps, wire)
        d.replica.in_flight += 1
        d.replica.in_flight -= 1


def main() -> None:
    n = 0
    for _ in range(2000):
        route(raw_of(n))
        n += 1
    out: dict[str, list[float]] = {}
    for _ in range(3):
        for name, step in (("body", body), ("+key", key), ("+route", route)):
            raws = [raw_of(n + i) for i in range(M)]
            n += M
            began = time.process_time()
            for raw in raws:
                step(raw)
            out.setdefault(name, []).append((time.process_time() - began) / M * 1e6)
    fastest = {name: min(v) for name, v in out.items()}
    fastest["policy"] = fastest["+route"] - fastest["+key"]
    assert pol.counts.fresh == n - 6 * M, pol.counts.as_dict()
    api = f"today's API, walk deal {pol._walk_deal}" if today else "d21257b's API"
    print(f"{api}, {len(reps)} replicas", {k: round(v, 2) for k, v in fastest.items()})


if __name__ == "__main__":
    main()
