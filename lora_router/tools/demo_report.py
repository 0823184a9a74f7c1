"""The closing table of `lora-router --demo` (demo.py runs it): requests per replica, affinity,
the prefix-cache hit rate against the best any routing could reach, the router's predicted
cached tokens against the reported, fence waits, loads and unloads, and the failures. Pure: a
function of the run's `DemoResult`, no I/O.
"""

from __future__ import annotations

import statistics

from lora_router.tools.demo import DemoResult
from lora_router.tools.table import render_table


def summary(result: DemoResult) -> str:
    """The closing table and the lines under it."""
    plan = result.plan
    rows = [
        (
            f"{i}  {r.name}",
            r.requests,
            f"{100 * r.requests / max(1, result.requests):.0f}%",
            f"{100 * r.hit_rate:.1f}%",
        )
        for i, r in enumerate(result.replicas)
    ]
    lagging = plan.mount_lag > 0 and plan.replicas > 1
    waits = sorted(result.fence_waits)
    loads = sorted(result.load_times)
    lines = [
        "",
        f"lora-router demo: {plan.steps} steps x {plan.prompts} prompts x G={plan.group} "
        f"over {plan.replicas} emulated replicas, --policy {plan.policy}"
        + "".join(f", --{k.replace('_', '-')} {v}" for k, v in plan.routing)
        + f", {result.wall:.1f} s",
        "",
        render_table(("replica", "requests", "share", "prefix-cache hits"), rows),
        "",
        f"  requests      {result.requests} ({result.streamed} streamed), "
        f"{len(result.failures)} failed",
        f"  affinity      {100 * result.affinity:.1f}% of samples ran on their group's "
        "majority replica",
        f"  prefix cache  {100 * result.hit_rate:.1f}% of prompt tokens were cache hits; "
        f"the best any routing could do: {100 * result.ideal_hit_rate:.1f}%",
        "                (each replica's vllm:prefix_cache_hits / vllm:prefix_cache_queries)",
    ]
    if result.counted:
        lines += [
            f"  prediction    the router expected {result.predicted_cached:,} cached prompt "
            f"tokens; the replicas reported {result.reported_cached:,}",
            "                (routing_accuracy in /router/status: usage.prompt_tokens_details)",
        ]
    else:
        lines.append(
            "  prediction    none: this policy predicts no cache hits (prefix and kv do), so "
            "nothing is compared"
        )
    if waits:
        lines.append(
            f"  fence         {len(waits)} requests waited for their adapter's load to finish: "
            f"median {statistics.median(waits):.2f} s, max {waits[-1]:.2f} s"
        )
        lines.append(
            f"                expected: the demo sends {plan.eager_groups} groups a step while "
            "their adapter is still loading\n"
            "                (an eager client); TRL names vN only once its load has answered, "
            "so with TRL\n                these waits are rare"
        )
    else:
        lines.append("  fence         no request had to wait")
    if loads:
        lines.append(
            f"  loads         {len(loads)} (v1..v{len(loads)}), each answered when every replica "
            f"had it: median {statistics.median(loads):.2f} s, "
            f"max {loads[-1]:.2f} s"
        )
    if lagging:
        lines.append(
            f"                replica {plan.replicas - 1}'s mount lags: 404 to the first "
            f"{plan.mount_lag} attempt(s) of each load, retried by the router"
        )
    lines.append(
        f"  unloads       {result.unloads} (v(N-{plan.max_staleness + 1}) after each sync)"
    )
    for failure in result.failures[:5]:
        lines.append(f"  FAILED: {failure}")
    lines.append("")
    lines.append("OK: the run completed." if result.ok else "FAILED: some requests failed.")
    return "\n".join(lines)
