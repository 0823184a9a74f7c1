"""The capacity model (batching.py): how a step is filled and timed, and the engine that runs
it, alone and over real sockets."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from helpers import until

from lora_router.emulator import EmulatorConfig, tokens
from lora_router.emulator.batching import (
    ITL_BUCKETS,
    InterTokenLatency,
    Progress,
    StepCosts,
    plan_step,
)
from lora_router.emulator.cli import build_parser, config_from_args
from lora_router.emulator.config import PROFILES
from lora_router.emulator.engine import Engine

from .conftest import StartEmulator

COMPLETIONS = "/v1/completions"


def run_to_end(seqs: list[Progress], budget: int, costs: StepCosts) -> tuple[float, int]:
    """Plan steps until no work is left: the seconds they take and how many there were."""
    seconds, steps = 0.0, 0
    while any(not p.done for p in seqs) and steps < 10_000:
        step, _ = plan_step([p for p in seqs if not p.done], budget)
        seconds += costs.step_s(step.decoding, step.prefill_tokens)
        steps += 1
    return seconds, steps


def test_decodes_fill_a_step_first_and_a_prefill_chunk_takes_what_is_left() -> None:
    decoding = [Progress(0, 5) for _ in range(3)]
    prefilling = Progress(100, 5)
    step, advanced = plan_step([prefilling, *decoding], budget=50)
    assert (step.decoding, step.prefill_tokens) == (3, 47)
    assert prefilling.prefill_left == 53
    assert all(p.decode_left == 4 and p.granted == 1 for p in decoding)
    assert set(advanced) == {prefilling, *decoding}


def test_a_long_prompt_is_prefilled_in_chunks_and_decodes_from_the_next_step() -> None:
    seq = Progress(100, 2)
    chunks = [plan_step([seq], budget=32)[0].prefill_tokens for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert seq.granted == 0  # the step that ends the prefill generates nothing yet
    step, _ = plan_step([seq], budget=32)
    assert (step.decoding, seq.granted) == (1, 1)


def test_the_budget_bounds_the_decoding_sequences_too() -> None:
    seqs = [Progress(0, 3) for _ in range(10)]
    step, advanced = plan_step(seqs, budget=4)
    assert step.decoding == 4
    assert advanced == seqs[:4]


def test_a_step_slows_as_its_batch_grows() -> None:
    costs = StepCosts(prefill_s_per_token=1e-4, decode_s_per_token=0.01, decode_s_per_seq=0.002)
    assert costs.step_s(1, 0) == pytest.approx(0.01)
    assert costs.step_s(8, 0) == pytest.approx(0.024)
    assert costs.step_s(8, 100) == pytest.approx(0.034)
    assert costs.step_s(0, 0) == 0.0


def test_half_speed_doubles_every_cost() -> None:
    full = StepCosts(1e-4, 0.01, 0.002)
    half = StepCosts(1e-4, 0.01, 0.002, speed=0.5)
    for decoding, prefill in ((1, 0), (8, 0), (0, 64), (5, 300)):
        assert half.step_s(decoding, prefill) == pytest.approx(2 * full.step_s(decoding, prefill))


def test_a_lone_sequence_costs_its_uncached_prompt_and_its_tokens() -> None:
    costs = StepCosts(prefill_s_per_token=1e-4, decode_s_per_token=0.01, decode_s_per_seq=0.002)
    seconds, _ = run_to_end([Progress(300, 20)], budget=128, costs=costs)
    assert seconds == pytest.approx(300 * 1e-4 + 20 * 0.01)


def test_siblings_decode_together_at_the_cost_of_a_growing_batch() -> None:
    costs = StepCosts(decode_s_per_token=0.01, decode_s_per_seq=0.002)
    together, steps = run_to_end([Progress(0, 20) for _ in range(8)], 8192, costs)
    assert steps == 20
    assert together == pytest.approx(20 * (0.01 + 7 * 0.002))
    alone, _ = run_to_end([Progress(0, 20)], 8192, costs)
    assert together < 8 * alone / 3  # one after the other: 1.6 s


def test_costs_and_speed_are_checked() -> None:
    with pytest.raises(ValueError, match="speed"):
        EmulatorConfig(speed=0)
    with pytest.raises(ValueError, match=">= 0"):
        EmulatorConfig(decode_s_per_seq=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EmulatorConfig(max_num_batched_tokens=0)


def test_a_profile_sets_the_costs_and_a_flag_overrides_one() -> None:
    args = build_parser().parse_args(["--profile", "tiny-cpu", "--decode-s-per-seq", "0.5"])
    config = config_from_args(args)
    profile = PROFILES["tiny-cpu"]
    assert config.prefill_s_per_token == profile.prefill_s_per_token
    assert config.decode_s_per_token == profile.decode_s_per_token
    assert config.decode_s_per_seq == 0.5
    plain = config_from_args(build_parser().parse_args(["--speed", "0.5"]))
    assert plain.step_costs == StepCosts(speed=0.5)


async def siblings(engine: Engine, n: int = 8, max_tokens: int = 20) -> list[float]:
    """`n` siblings of one prompt run on `engine` together, each to `max_tokens` tokens; the
    loop time each ended."""
    loop = asyncio.get_running_loop()
    prompt = [1, 2, 3]

    async def one(index: int) -> float:
        sample = tokens.generate(
            "m", prompt, seed=index, index=0, max_tokens=max_tokens, ignore_eos=True
        )

        async def emit(_: list[tokens.SampledToken]) -> None:
            return None

        await engine.run(engine.new_job(f"r{index}", None, prompt, [], sample), emit)
        return loop.time()

    return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 10)


async def test_the_engine_runs_siblings_in_one_batch() -> None:
    engine = Engine(EmulatorConfig(decode_s_per_token=0.01, decode_s_per_seq=0.002))
    began = asyncio.get_running_loop().time()
    ends = await siblings(engine)
    took = max(ends) - began
    # 20 steps of 8 sequences: 20 * 24 ms, where one after the other would take 8 * 200 ms.
    assert 0.45 <= took < 0.9
    assert max(ends) - min(ends) < 0.05


async def stream_times(
    client: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, float]:
    """Stream one completion: when its first and its last token arrived (monotonic clock)."""
    first = last = 0.0
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with client.post(url + COMPLETIONS, json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {"):
                last = time.monotonic()
                first = first or last
    return first, last


async def test_g_siblings_on_one_replica_decode_together_over_sockets(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.01, decode_s_per_seq=0.001)
    group = 8
    prompt = list(range(40))
    began = time.monotonic()
    times = await asyncio.wait_for(
        asyncio.gather(*(stream_times(client, emu.url, prompt, 30) for _ in range(group))), 20
    )
    # Their answers overlap: every sibling's first token came before any sibling finished.
    assert max(first for first, _ in times) < min(last for _, last in times)
    # 30 steps of 8: about 30 * 17 ms; one at a time would take 8 * 300 ms.
    took = max(last for _, last in times) - began
    assert 0.45 <= took < 1.2
    assert emu.state.counters.generated_tokens == group * 30


async def test_a_replica_at_half_speed_takes_twice_as_long(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    costs = {"prefill_s_per_token": 1e-3, "decode_s_per_token": 0.01, "decode_s_per_seq": 0.002}
    full = await start(**costs)
    half = await start(**costs, speed=0.5)

    async def group(url: str, first: int) -> float:
        # A new prompt each time (no cache hit): 100 ms of prefill at full speed, then 20
        # steps of 4.
        prompt = list(range(first, first + 100))
        began = time.monotonic()
        times = await asyncio.gather(*(stream_times(client, url, prompt, 20) for _ in range(4)))
        return max(last for _, last in times) - began

    # The least of three runs each, taken in turn: a loaded machine adds its delays to both,
    # which would pull the ratio towards 1; the least-delayed runs keep the model's own.
    full_s = half_s = float("inf")
    for i in range(3):
        full_s = min(full_s, await asyncio.wait_for(group(full.url, 1000 * i), 20))
        half_s = min(half_s, await asyncio.wait_for(group(half.url, 1000 * i), 20))
    assert 1.7 <= half_s / full_s <= 2.3, (full_s, half_s)


def test_a_token_s_latency_is_the_time_since_its_sequence_s_previous_one() -> None:
    # vLLM's vllm:inter_token_latency_seconds: none for a sequence's first token.
    itl = InterTokenLatency()
    a, b = Progress(0, 3), Progress(0, 3)
    itl.decoded([a, b], 0.0)
    assert (itl.count, itl.sum) == (0, 0.0)
    itl.decoded([a], 0.01)
    itl.decoded([b], 0.025)
    assert itl.count == 2 and itl.sum == pytest.approx(0.035)
    # Bucket upper bounds include their value, as Prometheus' `le`: 0.01 s and 0.025 s.
    assert itl.buckets[ITL_BUCKETS.index(0.01)] == 1
    assert itl.buckets[ITL_BUCKETS.index(0.025)] == 1
    itl.decoded([a, b], 200.0)
    assert itl.buckets[-1] == 2 and sum(itl.buckets) == itl.count == 4


@pytest.mark.parametrize("speed", [1.0, 0.5])
async def test_the_engine_s_token_latency_is_its_decode_step(speed: float) -> None:
    # 8 siblings of 20 tokens, decode 10 ms + 2 ms per further sequence: a step of 8 takes
    # 24 ms (48 ms at half speed); 19 latencies each. The engine's own step clock times them,
    # so a loaded machine can only lengthen them (a late wake-up), never shorten them.
    engine = Engine(EmulatorConfig(decode_s_per_token=0.01, decode_s_per_seq=0.002, speed=speed))
    await siblings(engine)
    itl = engine.inter_token_latency
    # The last step is observed once its time has passed: an answer may end before.
    await until(lambda: itl.count == 8 * 19)
    assert sum(itl.buckets) == itl.count
    step = 0.024 / speed
    assert step * 0.999 <= itl.sum / itl.count < step * 2, itl.sum / itl.count


async def test_metrics_show_the_token_latency_histogram(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.01)
    await asyncio.wait_for(stream_times(client, emu.url, list(range(40)), 12), 10)
    itl = emu.state.inter_token_latency
    await until(lambda: itl.count == 11)  # the last step's, once its time has passed
    async with client.get(emu.url + "/metrics") as response:
        page = (await response.text()).splitlines()
    line = next(x for x in page if x.startswith("vllm:inter_token_latency_seconds_count{"))
    assert float(line.rsplit(" ", 1)[1]) == 11
    line = next(x for x in page if x.startswith("vllm:inter_token_latency_seconds_sum{"))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(itl.sum) and itl.sum >= 0.0999
    buckets = [x for x in page if x.startswith("vllm:inter_token_latency_seconds_bucket{")]
    assert len(buckets) == len(ITL_BUCKETS) + 1 and 'le="+Inf"' in buckets[-1]
    assert float(buckets[-1].rsplit(" ", 1)[1]) == 11
