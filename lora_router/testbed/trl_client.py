"""TRL 1.16's own client code, driven without a trainer.

`VLLMClient` is TRL's control client as it is (`requests`). Rollouts are TRL's
`_AsyncRolloutLoop._generate_one_turn`, the coroutine that builds and posts every completion a
GRPO run sends (token-id prompt, `n: 1`, a fresh `seed` per request, `return_token_ids`,
`logprobs: 0`); it is called on a loop object that holds only the attributes that coroutine
reads, so the payloads are TRL's own and not a copy of them. TRL is pinned (1.16.0) by the
tier's install script, so these names are stable.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import aiohttp

LORA_NAME = "trl-policy"  # AsyncGRPOTrainer._lora_name


def vllm_client(url: str) -> Any:
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # TRL logs through accelerate, which insists on a state (a trainer makes one)

    return VLLMClient(url, server_timeout=60.0)


class Rollouts:
    """TRL's rollout requests against `url`, naming `trl-policy-v{version}` (or the base model
    when `version` is None), `max_tokens` each."""

    def __init__(self, url: str, base: str, version: int | None, max_tokens: int = 4) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

        loop = object.__new__(_AsyncRolloutLoop)
        loop.vllm_server_url = url.rstrip("/")
        loop.lora_name = None if version is None else LORA_NAME
        loop.model_name = base
        loop._model_version_value = SimpleNamespace(value=version or 0)  # the shared mp.Value
        loop.max_tokens = max_tokens
        loop.temperature = 1.0
        loop.top_p = 1.0
        loop.top_k = -1
        loop.min_p = None
        loop.repetition_penalty = 1.0
        loop.request_timeout = 600.0
        loop._counters = defaultdict(float)
        self._loop = loop

    @property
    def retries(self) -> float:
        """Transport failures TRL retried (it retries only those, not HTTP errors)."""
        return float(self._loop._counters["rollout/vllm_retry_total"])

    async def one(self, session: aiohttp.ClientSession, prompt: list[int]) -> list[int]:
        """One request as TRL sends it; TRL raises on any non-2xx answer."""
        self._loop.session = session
        token_ids, logprobs = await self._loop._generate_one_turn(prompt)
        assert len(token_ids) == len(logprobs)
        return list(token_ids)

    async def groups(self, prompts: list[list[int]], group_size: int) -> list[list[int]]:
        """GRPO groups: `group_size` separate requests per prompt, all in flight at once."""
        async with aiohttp.ClientSession() as session:
            tasks = [self.one(session, p) for p in prompts for _ in range(group_size)]
            return await asyncio.gather(*tasks)
