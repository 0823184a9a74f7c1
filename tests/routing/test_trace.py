"""lora_router/testbed/grpo_trace.py: the GRPO workload the routing benchmarks replay."""

from __future__ import annotations

from collections import Counter

import pytest

from lora_router.testbed import grpo_trace as trace

SPEC = trace.TraceSpec(
    steps=4, prompts_per_step=3, group_size=4, template_tokens=37, turns=3, version_every=2
)


def test_requests_come_in_submission_order():
    requests = list(trace.generate(SPEC))
    assert len(requests) == SPEC.requests
    assert [r.index for r in requests] == list(range(len(requests)))
    order = [(r.step, r.turn, r.family, r.sample) for r in requests]
    assert order == sorted(order)


def test_the_samples_of_a_group_start_as_siblings():
    first_turn = [r for r in trace.generate(SPEC) if r.turn == 0]
    by_family: dict[int, set[tuple[int, ...]]] = {}
    for r in first_turn:
        by_family.setdefault(r.family, set()).add(tuple(r.tokens))
    assert all(len(prompts) == 1 for prompts in by_family.values())
    assert Counter(r.family for r in first_turn) == {f: SPEC.group_size for f in by_family}


def test_every_prompt_starts_with_the_shared_template():
    requests = list(trace.generate(SPEC))
    template = requests[0].tokens[: SPEC.template_tokens]
    assert all(r.tokens[: SPEC.template_tokens] == template for r in requests)
    assert len({tuple(r.tokens[: SPEC.template_tokens + 1]) for r in requests}) > 1


def test_a_later_turn_extends_its_samples_previous_prompt():
    requests = list(trace.generate(SPEC))
    for r in requests:
        if r.turn:
            parent = requests[r.parent]
            assert (parent.family, parent.sample, parent.turn) == (r.family, r.sample, r.turn - 1)
            assert r.tokens[: len(parent.tokens)] == parent.tokens
            assert len(r.tokens) >= len(parent.tokens) + parent.completion_tokens
        else:
            assert r.parent is None


def test_the_samples_of_a_group_branch_at_their_second_turn():
    requests = list(trace.generate(SPEC))
    second = {tuple(r.tokens) for r in requests if r.turn == 1 and r.family == 0}
    assert len(second) == SPEC.group_size


def test_a_new_adapter_version_every_k_steps():
    models = {r.step: r.model for r in trace.generate(SPEC)}
    assert models == {
        0: "trl-policy-v1",
        1: "trl-policy-v1",
        2: "trl-policy-v2",
        3: "trl-policy-v2",
    }


def test_the_same_spec_gives_the_same_trace():
    assert list(trace.generate(SPEC)) == list(trace.generate(SPEC))
    other = trace.TraceSpec(steps=1, seed=SPEC.seed + 1)
    assert next(trace.generate(other)).tokens != next(trace.generate(SPEC)).tokens


def test_a_spec_rejects_empty_shapes():
    with pytest.raises(ValueError):
        trace.TraceSpec(group_size=0)
    with pytest.raises(ValueError):
        trace.TraceSpec(problem_tokens=(10, 5))
