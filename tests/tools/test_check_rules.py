"""The rules of `lora-router --check`, on facts as the probes would report them (no sockets)."""

from __future__ import annotations

import fnmatch
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from lora_router.fleet.leftovers import stale_glob
from lora_router.tools.check import ReplicaFacts, judge, report


def ready(name: str = "http://a:8000", **changes: object) -> ReplicaFacts:
    facts = ReplicaFacts(
        name=name,
        version="0.32.0",
        base_model="Qwen/Qwen2.5-Math-1.5B",
        max_model_len=4096,
        lora=True,
        max_lora_rank=16,
        max_loras=6,
        block_size=16,
        data_parallel_size=1,
        dev_mode=True,
        runtime_loading=True,
        paused=False,
    )
    return replace(facts, **changes)  # type: ignore[arg-type]


def errors(fleet: list[ReplicaFacts], **kwargs: object) -> list[str]:
    kwargs.setdefault("max_staleness", 4)
    return [p.what for p in judge(fleet, **kwargs) if not p.note]  # type: ignore[arg-type]


def test_a_ready_fleet_has_no_problem() -> None:
    assert judge([ready("http://a:1"), ready("http://b:1")], max_staleness=4) == []


def test_data_parallel_above_one_is_refused() -> None:
    (what,) = errors([ready(data_parallel_size=2)])
    assert "data_parallel_size is 2" in what


def test_max_loras_must_cover_max_staleness_plus_two() -> None:
    assert errors([ready(max_loras=6)], max_staleness=4) == []
    (what,) = errors([ready(max_loras=6)], max_staleness=5)
    assert "below max_staleness + 2 = 7" in what


def test_a_disagreement_names_the_field_with_the_odd_replicas_value() -> None:
    (what,) = errors([ready("http://a:1"), ready("http://b:1", block_size=32)])
    assert "block size" in what and "32 on http://b:1" in what


def test_an_unreachable_replica_is_its_only_problem() -> None:
    down = ReplicaFacts(name="http://b:1", answer="unreachable", detail="cannot connect")
    (what,) = errors([ready("http://a:1"), down])
    assert what.startswith("unreachable")


def test_leftover_adapters_are_a_problem_unless_unload_stale_matches_them_all() -> None:
    reused = ready(adapters=["trl-policy-v1", "trl-policy-v2"])
    assert len(errors([reused])) == 1
    assert errors([reused], unload_stale="trl-policy-*") == []
    assert len(errors([reused], unload_stale="other-*")) == 1


def test_a_paused_replica_is_a_note_not_a_failure() -> None:
    problems = judge([ready(paused=True)], max_staleness=4)
    assert problems and all(p.note for p in problems)


def test_the_report_ends_with_the_verdict() -> None:
    fleet = [ready(lora=False, max_lora_rank=None, max_loras=None)]
    text = report(fleet, judge(fleet, max_staleness=4), max_staleness=4)
    assert "LoRA is disabled" in text and "--enable-lora" in text
    assert text.splitlines()[-1].startswith("NOT READY: 1 problem")
    good = [ready()]
    assert report(good, [], max_staleness=4).splitlines()[-1].startswith("READY")


def fixes(fleet: list[ReplicaFacts], **kwargs: object) -> list[tuple[bool, str]]:
    kwargs.setdefault("max_staleness", 4)
    return [(p.note, p.fix) for p in judge(fleet, **kwargs)]  # type: ignore[arg-type]


def test_only_a_name_the_trainer_may_load_is_fatal() -> None:
    assert errors([ready(adapters=["my-adapter", "base-sft"])]) == []
    (what,) = errors([ready(adapters=["my-adapter", "trl-policy-v3"])])
    assert "trl-policy-v3" in what and "my-adapter" not in what
    # --lineage-pattern says how the trainer names its versions.
    custom = {"lineage_pattern": r"(?P<lineage>.+)@\d+"}
    assert errors([ready(adapters=["trl-policy-v3"])], **custom) == []
    (what,) = errors([ready(adapters=["policy@3"])], **custom)
    assert "policy@3" in what


def test_the_unload_stale_advice_is_one_glob_for_the_whole_fleet() -> None:
    fleet = [ready("http://a:1", adapters=["trl-policy-v1"]), ready("http://b:1")]
    fleet.append(ready("http://c:1", adapters=["trl-policy-v12", "my-adapter"]))
    advice = fixes(fleet)
    fatal = {fix for note, fix in advice if not note}
    assert fatal == {
        "give --unload-stale 'trl-policy-v1*' (the router unloads them at start), "
        "or restart the replica"
    }
    (note,) = [fix for note, fix in advice if note]
    assert note.startswith("to clear them, give --unload-stale '*'")


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5))
def test_the_glob_matches_every_name_it_was_built_from(names: list[str]) -> None:
    glob = stale_glob(names)
    assert all(fnmatch.fnmatchcase(name, glob) for name in names)
    if len(set(names)) == 1:  # one name: that name only
        assert not fnmatch.fnmatchcase(names[0] + "x", glob)


def test_a_url_path_that_is_not_a_server_is_the_one_problem() -> None:
    lost = ReplicaFacts(name="http://a:8000/v1", answer="wrong path", detail="404 under /v1")
    (problem,) = judge([lost], max_staleness=4)
    assert not problem.note and problem.fix == "give the server's root URL: http://a:8000"


def test_without_lora_the_missing_load_route_is_the_lora_problem() -> None:
    (what,) = errors([ready(lora=False, max_lora_rank=None, max_loras=None, runtime_loading=False)])
    assert what.startswith("LoRA is disabled")
    (what,) = errors([ready(runtime_loading=False)])
    assert what.startswith("runtime adapter loading is off")
