"""`routing_accuracy`: the cached prompt tokens the policy predicted against those the replicas
reported, per replica and per lineage, for `/router/status`, `/metrics` and `top` (which answers
count and how each figure is read: proxy/usage.py; recorded in metrics.py's `CacheAccount`).

Rules:
- Each figure covers the answers that carried vLLM's report (`answers`); `unreported` counts
  the counted answers that did not (a replica without `--enable-prompt-tokens-details`).
- `ratio` is reported / predicted (None with nothing predicted). A continuation predicts its
  earlier prompt only, where vLLM also kept the earlier completion's blocks, and a new family
  predicts nothing, where a shared preamble may be cached: so a healthy ratio is at or above 1.
- The fleet is *overpredicting* when, over at least `MIN_ANSWERS` answers, the predicted
  tokens exceed the reported by more than `OVERPREDICTION` of the predicted: prompts are sent
  to caches that no longer hold them (evictions under cache pressure, a replica restarted
  behind the router's back, a `--block-size` other than the replicas').

Reads, never writes: built when asked for, from the recorded counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric

from lora_router.observe.metrics import CacheAccount, Rows, counter, gauge

MIN_ANSWERS = 100
OVERPREDICTION = 0.2
BASE = "-"  # the lineage label of requests that named no model


def _figures(row: list[int], unreported: int) -> dict[str, object]:
    answers, predicted, reported = row
    return {
        "answers": answers,
        "predicted_cached_tokens": predicted,
        "reported_cached_tokens": reported,
        "ratio": round(reported / predicted, 4) if predicted else None,
        "unreported": unreported,
    }


def overpredicting(row: list[int]) -> bool:
    """Whether `[answers, predicted, reported]` is overpredicting (module docstring)."""
    answers, predicted, reported = row
    return answers >= MIN_ANSWERS and predicted - reported > OVERPREDICTION * predicted


def totals(rows: Iterable[list[int]]) -> list[int]:
    """`[answers, predicted, reported]` over `rows`."""
    total = [0, 0, 0]
    for row in rows:
        for i, value in enumerate(row):
            total[i] += value
    return total


def accuracy_json(account: CacheAccount) -> dict[str, object]:
    """The `routing_accuracy` section of `/router/status`: the fleet's figures, its
    `overpredicting` flag, then the same figures per replica id and per lineage."""
    replicas: dict[str, list[list[int]]] = {}
    lineages: dict[str, list[list[int]]] = {}
    for (label, lineage), row in account.reported.items():
        replicas.setdefault(label.decode(), []).append(row)
        lineages.setdefault(lineage or BASE, []).append(row)
    unreported = {label.decode(): n for label, n in account.unreported.items()}
    for rid in unreported:
        replicas.setdefault(rid, [])
    fleet = totals(account.reported.values())
    return {
        **_figures(fleet, sum(unreported.values())),
        "overpredicting": overpredicting(fleet),
        "replicas": {
            rid: _figures(totals(rows), unreported.get(rid, 0))
            for rid, rows in sorted(replicas.items(), key=lambda item: _by_id(item[0]))
        },
        "lineages": {name: _figures(totals(rows), 0) for name, rows in sorted(lineages.items())},
    }


def _by_id(label: str) -> tuple[bool, int]:
    """Replica ids in order, then the label of the replicas removed (metrics.py DEPARTED)."""
    return (not label.isdigit(), int(label) if label.isdigit() else 0)


def accuracy_families(account: CacheAccount) -> Iterator[Metric]:
    """The `/metrics` families of the same figures, by replica and lineage."""
    labels = ["replica", "lineage"]
    rows = sorted(account.reported.items())

    def by(column: int) -> Rows:
        return [([label.decode(), lineage or BASE], row[column]) for (label, lineage), row in rows]

    yield counter(
        "lora_router_cache_reports",
        "Routed answers whose cached prompt tokens the replica reported (token-id prompts).",
        labels,
        by(0),
    )
    yield counter(
        "lora_router_predicted_cached_tokens",
        "Cached prompt tokens the routing policy predicted, over the reported answers.",
        labels,
        by(1),
    )
    yield counter(
        "lora_router_reported_cached_tokens",
        "Cached prompt tokens the replicas reported reusing (usage.prompt_tokens_details).",
        labels,
        by(2),
    )
    yield counter(
        "lora_router_cache_unreported",
        "Routed answers of token-id prompts that carried no cached-token report.",
        ["replica"],
        [([label.decode()], n) for label, n in sorted(account.unreported.items())],
    )
    yield gauge(
        "lora_router_overpredicting",
        "1 when the predicted cached tokens run far above the reported (routing_accuracy).",
        [],
        [([], float(overpredicting(totals(row for _, row in rows))))],
    )
