"""Routing: which replica gets a completion. Pure functions of their inputs, tested without sockets.

- `keys`: a prompt as vLLM's prefix cache sees it, seeded by the model (adapter version): one
  xxh3 hash of the whole prompt (all a repeated prompt needs) and, only when asked for, chained
  xxh3 hashes of whole blocks; fallbacks for text, chat and batches are documented there.
- `ring`: a consistent-hash ring of replica names with virtual nodes.
- `affinity`: a bounded LRU table of where recent prompts went, answering "which earlier
  prompts does this one start with?" at any length.
- `ranks`: the members kept in dealing order, for a new family's replica.
- `policy`: the policies behind `--policy`: `prefix` (exact-prefix affinity + consistent
  hashing with bounded loads), and `round-robin` and `least-loaded` (one `KeyBlind` policy
  given its pick); `make_policy` builds one.
- `contract`: what a policy and its caller exchange (`Candidates`, `Decision`, `Policy`), and
  the strategy a `prefix` policy may be given for a new family (`Prefer`).
- `kv_index`: what each replica's cache really holds, from its KV events, in these keys;
- `kv_policy`: `kv`, `prefix` given a `KvLookup`: a new family sent where the KV index finds
  its prefix.

The rules, and the measurements that chose them: docs/design/routing.md.

The HTTP layer turns a validated completion into one `RouteKey` (`completion_key`: the wire
hash at once, the block key only if the policy asks for it), asks `policy.choose(key,
routable)` with the fleet's kept `Candidates` for the model, drops the key, and counts the
request in flight on the replica it gets (telling the policy, `load_changed`). Nothing in
this package does I/O, reads a clock, draws random numbers, logs, or changes a replica; no
step of a routed request's choice walks the fleet (policy.py states each step's cost).
"""

from .keys import Lineages, PromptKey, RouteKey, completion_key, prompt_key, text_key, wire_key
from .policy import (
    POLICIES,
    Candidates,
    Decision,
    DecisionCounts,
    KeyBlind,
    Policy,
    PrefixAffinity,
    make_policy,
)
from .ring import HashRing

__all__ = [
    "POLICIES",
    "Candidates",
    "Decision",
    "DecisionCounts",
    "HashRing",
    "KeyBlind",
    "Lineages",
    "Policy",
    "PrefixAffinity",
    "PromptKey",
    "RouteKey",
    "completion_key",
    "make_policy",
    "prompt_key",
    "text_key",
    "wire_key",
]
