"""Whether a replica can take part in TRL's weight sync: one notion, for the router and `--check`.

A TRL sync is `/pause`, `/v1/load_lora_adapter`, `/resume` and an unload on every replica. A
replica takes part only with all of:

| needs | vLLM flag | a "yes" | a "no" |
| --- | --- | --- | --- |
| LoRA | `--enable-lora` | `/server_info`'s `lora_config` | null |
| dev mode | `VLLM_SERVER_DEV_MODE=1` | `/server_info` answers | FastAPI's 404 |
| runtime loading | `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` | `/server_info`'s `vllm_env` | false |

Without LoRA vLLM has no adapter routes whatever the runtime-loading variable says, so the
missing route is then the LoRA problem, never both.

What the router does with a replica that lacks one (docs/design/fleet.md#readiness): it keeps
serving the routes it can (completions for the base model and the adapters it holds), with the
problems as a standing warning: logged when found, shown on the replica in `/router/status` and
`lora-router top`; `/health` answers 503 naming the first problem when no replica in service
can take part, since the trainer's first sync would fail. `--check` fails on each problem.

Pure: facts in, named failures (fleet/failure.py's causes and fixes) out; `None` means "not
seen", and is never a problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lora_router.fleet.client import Facts
from lora_router.fleet.failure import FIX, Cause, Failure


@dataclass(frozen=True, slots=True)
class SyncFacts:
    """What a replica showed of the three needs (module docstring); None: not seen."""

    lora: bool | None = None
    dev_mode: bool | None = None
    runtime_loading: bool | None = None


def seen_in(info: Facts | Failure) -> SyncFacts:
    """The needs a replica's `/server_info` shows (`info`, as the replica client read it: its
    facts, or why it did not answer; a route it lacks is no dev mode)."""
    if isinstance(info, Facts):
        return SyncFacts(lora=info.lora, dev_mode=True, runtime_loading=info.runtime_loading)
    return SyncFacts(dev_mode=False if info.cause is Cause.DEV_MODE else None)


def loras_needed(max_staleness: int) -> int:
    """Adapter slots a TRL run needs: max_staleness + 1 versions in use, plus one loading."""
    return max_staleness + 2


def sync_problems(facts: SyncFacts, loras_needed: int) -> list[Failure]:
    """Why a replica cannot take part in a weight sync (empty: it can, as far as was seen).
    `loras_needed`: the `--max-loras` a fix names (max_staleness + 2)."""
    out: list[Failure] = []
    if facts.lora is False:
        out.append(
            Failure(
                Cause.NO_LORA,
                "LoRA is disabled (vllm_config.lora_config is null): TRL would fall back to "
                "merged-weight sync (/init_weight_transfer_engine, /update_weights), which "
                "reaches one replica only, so lora-router refuses it and training stops",
                f"start it with --enable-lora --max-lora-rank R --max-loras {loras_needed} "
                "(R: your LoraConfig's r rounded up to 1, 8, 16, 32, 64, ...)",
            )
        )
    if facts.runtime_loading is False and facts.lora is not False:
        out.append(
            Failure(
                Cause.RUNTIME_LOADING,
                "runtime adapter loading is off: POST /v1/load_lora_adapter does not exist",
                FIX[Cause.RUNTIME_LOADING],
            )
        )
    if facts.dev_mode is False:
        out.append(
            Failure(
                Cause.DEV_MODE,
                "dev mode is off: /pause, /resume and /server_info do not exist",
                FIX[Cause.DEV_MODE],
            )
        )
    return out


def load_failure(failure: Failure, unready: Sequence[Failure]) -> Failure:
    """A failed adapter load's cause on a replica whose sync problems are `unready`: a missing
    load route (runtime loading off) on one seen without LoRA is the LoRA problem (module
    docstring), whose fix is the one that helps; any other failure as it is."""
    if failure.cause is Cause.RUNTIME_LOADING:
        return next((f for f in unready if f.cause is Cause.NO_LORA), failure)
    return failure
