"""Reading a replica's `/metrics` and timing the fleet's syncs, without sockets.

`data/vllm-0.32-metrics.txt` is the `/metrics` answer of a real vLLM 0.32 CPU server
(`--enable-lora --max-loras 3 --enable-prefix-caching`, a tiny Qwen2, before its first request):
~700 lines, every family vLLM exposes. `data/vllm-0.32-metrics-after-traffic.txt` is the same
server after 16 completions of 200 prompt and 400 generated tokens under adapter
`trl-policy-v1`, loaded through the router. vLLM's `vllm:lora_requests_info` is a
prometheus-client `Gauge` set to the current time under a new label set at every step; the
tests build more of it the same way.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from pytest import approx

from lora_router.fleet import telemetry
from lora_router.fleet.report import Report
from lora_router.fleet.telemetry import (
    MAX_LINE_BYTES,
    WINDOW_S,
    MetricsError,
    ReportReader,
    SyncClock,
    parse_report,
)

DATA = Path(__file__).parent / "data"
REAL = (DATA / "vllm-0.32-metrics.txt").read_bytes()
AFTER_TRAFFIC = (DATA / "vllm-0.32-metrics-after-traffic.txt").read_bytes()


def with_values(text: bytes, **values: float) -> bytes:
    """The exposition with each named family's samples set to a value (`name__total=`...)."""
    out = []
    for line in text.splitlines():
        for name, value in values.items():
            sample = name.replace("__", ":", 1).encode()
            if line.startswith(sample + b"{"):
                line = line[: line.rfind(b"}") + 1] + b" " + repr(value).encode()
        out.append(line)
    return b"\n".join(out) + b"\n"


def lora_info(*label_sets: tuple[str, str, float]) -> bytes:
    """`vllm:lora_requests_info` as vLLM renders it: (running, waiting, value) per label set."""
    registry = CollectorRegistry()
    gauge = Gauge(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=registry,
    )
    for running, waiting, value in label_sets:
        gauge.labels(
            max_lora="3", waiting_lora_adapters=waiting, running_lora_adapters=running
        ).set(value)
    return generate_latest(registry)


def test_a_real_vllm_exposition_is_read() -> None:
    text = with_values(
        REAL,
        vllm__num_requests_running=3,
        vllm__num_requests_waiting=2,
        vllm__kv_cache_usage_perc=0.25,
        vllm__prefix_cache_queries_total=1000,
        vllm__prefix_cache_hits_total=750,
        vllm__generation_tokens_total=4096,
        vllm__prompt_tokens_total=2048,
    )
    report = parse_report(text, at=1.0)
    assert (report.running, report.waiting) == (3, 2)
    assert report.kv_cache_usage == 0.25
    assert (report.prefix_queries, report.prefix_hits) == (1000, 750)
    assert report.hit_rate_total == 0.75
    assert (report.generation_tokens, report.prompt_tokens) == (4096, 2048)
    # `vllm:num_requests_waiting_by_reason` and the `_created` samples are other families.
    assert report.adapters_running is None  # no LoRA request was ever scheduled


def test_a_real_vllm_exposition_after_lora_traffic_is_read() -> None:
    report = parse_report(AFTER_TRAFFIC, at=1.0)
    assert (report.running, report.waiting) == (0, 0)
    assert (report.prefix_queries, report.prefix_hits) == (3200, 1536)
    assert (report.prompt_tokens, report.generation_tokens) == (3200, 6400)
    # Two label sets: "trl-policy-v1" running and waiting, then the idle one, set later.
    assert AFTER_TRAFFIC.count(b"\nvllm:lora_requests_info{") == 2
    assert report.adapters_running == () and report.adapters_waiting == ()
    assert report.max_lora == 3


def test_the_decode_step_is_the_inter_token_latency_over_the_interval() -> None:
    # vllm:inter_token_latency_seconds' sum and count, not its buckets (nor
    # vllm:request_time_per_output_token_seconds, observed only when a request ends).
    after = parse_report(AFTER_TRAFFIC, at=12.0)
    assert (after.token_latency_sum, after.token_latency_count) == (665.5941000779985, 6384)
    before = parse_report(REAL, at=10.0)
    assert (before.token_latency_sum, before.token_latency_count) == (0, 0)
    assert after.decode_step_s is None  # no interval yet
    step = after.following(before, False)
    assert (step.interval_token_latency, step.interval_decoded) == (665.5941000779985, 6384)
    assert step.decode_step_s == pytest.approx(665.5941000779985 / 6384)
    assert after.following(after, False).decode_step_s is None  # nothing decoded in it


def test_a_replica_without_the_inter_token_latency_reports_the_rest() -> None:
    lines = [x for x in AFTER_TRAFFIC.splitlines() if b"inter_token_latency" not in x]
    report = parse_report(b"\n".join(lines), at=12.0)
    assert report.token_latency_sum is None and report.token_latency_count is None
    assert report.generation_tokens == 6400
    assert report.following(parse_report(REAL, at=10.0), False).decode_step_s is None


def test_the_newest_lora_label_set_is_the_current_one() -> None:
    # vLLM never drops a label set: the idle set from start-up comes back, newest value wins.
    text = REAL + lora_info(("", "", 100.0), ("v1,v2", "v3", 200.0), ("v1", "", 150.0))
    report = parse_report(text, at=1.0)
    assert report.adapters_running == ("v1", "v2") and report.adapters_waiting == ("v3",)
    assert report.max_lora == 3
    idle_again = REAL + lora_info(("", "", 300.0), ("v1,v2", "v3", 200.0))
    assert parse_report(idle_again, at=1.0).adapters_running == ()


def test_the_engines_of_a_data_parallel_replica_add_up() -> None:
    text = b"".join(
        f'{name}{{engine="{e}",model_name="m"}} {value}\n'.encode()
        for e in (0, 1)
        for name, value in (
            ("vllm:num_requests_running", 2 + e),
            ("vllm:num_requests_waiting", e),
            ("vllm:kv_cache_usage_perc", 0.2 + 0.4 * e),
            ("vllm:prefix_cache_queries_total", 100),
            ("vllm:prefix_cache_hits_total", 50),
            ("vllm:generation_tokens_total", 10),
            ("vllm:prompt_tokens_total", 20),
        )
    )
    report = parse_report(text, at=1.0)
    assert (report.running, report.waiting) == (5, 1)
    assert report.kv_cache_usage == pytest.approx(0.4)
    assert (report.prefix_queries, report.generation_tokens) == (200, 20)


def test_interval_figures_are_taken_against_the_previous_report() -> None:
    first = parse_report(
        with_values(REAL, vllm__prefix_cache_queries_total=100, vllm__generation_tokens_total=50),
        at=10.0,
    )
    assert first.hit_rate is None and first.tokens_per_s is None  # nothing to compare with yet
    second = parse_report(
        with_values(
            REAL,
            vllm__prefix_cache_queries_total=300,
            vllm__prefix_cache_hits_total=180,
            vllm__generation_tokens_total=250,
        ),
        at=12.0,
    ).following(first, False)
    assert second.interval == 2.0
    assert second.hit_rate == 180 / 200
    assert second.hit_rate_total == 180 / 300
    assert second.tokens_per_s == 100.0


def test_a_counter_that_went_down_counts_from_zero() -> None:
    before = parse_report(with_values(REAL, vllm__generation_tokens_total=5000), at=0.0)
    restarted = parse_report(with_values(REAL, vllm__generation_tokens_total=40), at=4.0)
    assert restarted.following(before, False).tokens_per_s == 10.0


@given(st.binary(max_size=300))
def test_any_answer_is_read_or_refused_with_a_reason(body: bytes) -> None:
    try:
        parse_report(body, at=0.0)
    except MetricsError as exc:
        assert str(exc)


@given(st.text(max_size=200))
def test_any_text_after_a_sample_name_is_read_or_refused(tail: str) -> None:
    try:
        parse_report(REAL + b"vllm:num_requests_running" + tail.encode(), at=0.0)
    except MetricsError as exc:
        assert str(exc)


def test_a_sync_runs_from_pause_to_resume() -> None:
    clock = SyncClock()
    t0 = clock.started
    clock.pause(t0 + 10)
    clock.pause(t0 + 11)  # a second pause extends the sync
    assert clock.paused_seconds(t0 + 12) == 2.0
    clock.resume(t0 + 14)
    clock.resume(t0 + 15)  # a resume without a pause is no sync
    assert clock.count == 1 and clock.seconds == 4.0
    assert clock.recent(t0 + 20) == [(6.0, 4.0)]
    assert clock.share_total(t0 + 20) == 4.0 / 20
    assert clock.durations.counts[clock.durations.bounds.index(5.0)] == 1


def test_the_seconds_an_interval_spent_paused_are_known() -> None:
    clock = SyncClock()
    t0 = clock.started
    assert clock.paused_within(t0, t0 + 10) == approx(0.0)
    clock.pause(t0 + 10)
    assert clock.paused_within(t0 + 5, t0 + 11) == approx(1.0)  # paused now
    clock.resume(t0 + 12)
    assert clock.paused_within(t0 + 5, t0 + 13) == approx(2.0)  # the whole sync inside
    assert clock.paused_within(t0 + 11, t0 + 13) == approx(1.0)  # its end inside
    assert clock.paused_within(t0 + 9, t0 + 10.5) == approx(0.5)  # its start inside
    assert clock.paused_within(t0 + 12.5, t0 + 14) == approx(0.0)  # after it
    clock.pause(t0 + 20)
    clock.resume(t0 + 20.25)
    assert clock.paused_within(t0 + 11, t0 + 21) == approx(1.25)  # two syncs
    # An interval older than the syncs kept: none of it is known unpaused.
    assert clock.paused_within(t0, t0 + WINDOW_S + 1) == approx(WINDOW_S + 1)


def test_the_paused_share_looks_at_the_last_window_only() -> None:
    clock = SyncClock()
    t0 = clock.started
    clock.pause(t0 + 100)
    clock.resume(t0 + 160)
    clock.pause(t0 + 390)
    # At t0+400: window [100, 400]; 60 s of the first sync and 10 s of the running one.
    assert clock.share(t0 + 400, window=300) == pytest.approx(70 / 300)
    # At t0+470 the first sync has left the window; the running one is 80 s old.
    assert clock.share(t0 + 470, window=300) == pytest.approx(80 / 300)
    assert clock.share_total(t0 + 470) == pytest.approx(140 / 470)


def test_a_refusal_quotes_little_of_the_answer() -> None:
    with pytest.raises(MetricsError, match=r"^not a Prometheus exposition") as refused:
        parse_report(b"vllm:num_requests_running{" + b"x" * 10_000 + b"\n", at=0.0)
    assert len(str(refused.value)) < 200


@given(st.text(st.characters(blacklist_characters=",", blacklist_categories=("Cs",)), max_size=40))
def test_escaped_label_values_read_as_prometheus_client_wrote_them(name: str) -> None:
    report = parse_report(REAL + lora_info((name, name, 1.0)), at=0.0)
    assert report.adapters_running == report.adapters_waiting == ((name,) if name else ())


def test_only_the_lines_of_the_families_read_are_looked_at() -> None:
    # A family whose name begins with a read one is another family; its lines never count.
    text = with_values(REAL, vllm__num_requests_running=2) + (
        b'vllm:num_requests_running_max{engine="0"} 99\n'
        b"vllm:num_requests_running_other not-a-number\n"
    )
    assert parse_report(text, at=0.0).running == 2


def test_a_replica_holding_work_is_still_from_the_first_report_its_counters_stood_at() -> None:
    first = parse_report(REAL, at=10.0)
    second = parse_report(REAL, at=12.0).following(first, True)
    third = parse_report(REAL, at=14.0).following(second, True)
    assert (second.still_since, third.still_since) == (10.0, 10.0)
    assert parse_report(REAL, at=14.0).following(second, False).still_since is None  # idle
    moved = replace(parse_report(REAL, at=14.0), prompt_tokens=first.prompt_tokens + 1)
    assert moved.following(second, True).still_since is None  # it computed a prompt token


# -- the page read as it arrives --------------------------------------------------------------

# The real page after LoRA traffic, with more label sets of vllm:lora_requests_info (ties,
# escapes, an older set coming back newest) and a sample of a second engine.
LONG_RUN = (
    AFTER_TRAFFIC
    + lora_info(
        ("trl-policy-v1,trl-policy-v2", "trl-policy-v2", 1.7961260690e9),
        ('a "quoted"\\name', "", 1.7961260700e9),
        ("trl-policy-v2", "trl-policy-v2", 1.7961260700e9),  # a tie: the later line wins
        ("trl-policy-v1", "", 1.7961260650e9),
    )
    + b'vllm:num_requests_running{engine="1",model_name="m"} 4.0\n'
)
BROKEN = AFTER_TRAFFIC + b'vllm:kv_cache_usage_perc{engine="1" 0.5\n'


def read_in_pieces(text: bytes, cuts: Iterable[int], at: float = 1.0) -> Report | str:
    """`text` fed to a reader cut at `cuts`: its report, or the refusal's message."""
    reader = ReportReader()
    start = 0
    try:
        for cut in [*sorted(cuts), len(text)]:
            reader.feed(text[start:cut])
            start = cut
        return reader.finish(at)
    except MetricsError as exc:
        return str(exc)


def read_whole(text: bytes, at: float = 1.0) -> Report | str:
    try:
        return parse_report(text, at)
    except MetricsError as exc:
        return str(exc)


def test_the_long_run_page_reads_its_newest_label_set() -> None:
    report = parse_report(LONG_RUN, at=1.0)
    assert report.adapters_running == report.adapters_waiting == ("trl-policy-v2",)
    assert report.running == 4  # both engines
    idle = replace(report, running=0, adapters_running=(), adapters_waiting=())
    assert parse_report(AFTER_TRAFFIC, at=1.0) == idle


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 64 << 10])
def test_a_page_read_in_pieces_of_any_size_reads_as_the_whole(size: int) -> None:
    for text in (REAL, LONG_RUN, BROKEN):
        cuts = range(size, len(text), size)
        assert read_in_pieces(text, cuts) == read_whole(text)


def _read_positions(text: bytes) -> list[int]:
    """Every offset within or around the lines of the families read: cuts in a name, its
    labels, an escape, a value, at a newline and either side of it."""
    names = (b"\nvllm:num_requests_", b"\nvllm:kv_cache", b"\nvllm:lora_", b"\nvllm:prefix_cache")
    positions: set[int] = set()
    for name in names:
        at = text.find(name)
        while at >= 0:
            end = text.find(b"\n", at + 1)
            positions.update(range(at - 1, (end if end >= 0 else len(text)) + 2))
            at = text.find(name, at + 1)
    return sorted(p for p in positions if 0 <= p <= len(text))


PAGES = {"real": REAL, "long-run": LONG_RUN, "broken": BROKEN}
POSITIONS = {name: _read_positions(text) for name, text in PAGES.items()}


@given(st.data())
def test_a_page_cut_anywhere_reads_as_the_whole(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(PAGES)))
    text = PAGES[name]
    cut = st.one_of(st.sampled_from(POSITIONS[name]), st.integers(0, len(text)))
    cuts = data.draw(st.lists(cut, max_size=12))
    assert read_in_pieces(text, cuts) == read_whole(text)


def test_a_line_of_a_family_read_is_refused_past_its_cap() -> None:
    value = b"x" * MAX_LINE_BYTES
    for line in (
        b'vllm:lora_requests_info{max_lora="3",running_lora_adapters="' + value + b'"} 1\n',
        b'vllm:num_requests_running{engine="' + value + b'"} 1\n',
    ):
        text = AFTER_TRAFFIC + line
        refused = read_whole(text)
        assert isinstance(refused, str) and "line longer than 256 KiB" in refused
        assert read_in_pieces(text, range(0, len(text), 64 << 10)) == refused


def test_a_long_line_of_a_family_not_read_is_skipped() -> None:
    long = b"x" * (2 * MAX_LINE_BYTES)
    text = (
        AFTER_TRAFFIC[:200]
        + b"# HELP " + long + b"\n"
        + b'vllm:num_requests_running_total{engine="' + long + b'"} 1\n'
        + AFTER_TRAFFIC[200:]
    )  # fmt: skip
    assert read_whole(text) == read_whole(AFTER_TRAFFIC)
    assert read_in_pieces(text, range(0, len(text), 64 << 10)) == read_whole(AFTER_TRAFFIC)
    # The last line, cut off by the end of the answer, is skipped as well.
    assert read_in_pieces(AFTER_TRAFFIC + b"# " + long, [len(AFTER_TRAFFIC) + 1]) == (
        read_whole(AFTER_TRAFFIC)
    )


def test_reading_a_page_keeps_at_most_a_few_lines_whatever_its_size() -> None:
    piece = lora_info(*((f"trl-policy-v{i}", "", 2e9 + i) for i in range(600)))
    piece = piece[piece.index(b"\nvllm:lora_requests_info{") + 1 :]  # whole sample lines
    comment = b"x" * (64 << 10)
    tracemalloc.start()
    try:
        reader = ReportReader()
        reader.feed(AFTER_TRAFFIC)
        for _ in range((16 << 20) // len(piece)):  # 16 MiB of label sets
            reader.feed(piece)
        reader.feed(b"# ")
        for _ in range(64):  # a 4 MiB line
            reader.feed(comment)
        reader.feed(b"\n")
        report = reader.finish(1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.adapters_running == ("trl-policy-v599",)
    assert peak < 2 << 20


def test_a_page_over_the_cap_is_refused_naming_what_clears_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "MAX_PAGE_BYTES", len(AFTER_TRAFFIC) - 1)
    refused = read_in_pieces(AFTER_TRAFFIC, range(0, len(AFTER_TRAFFIC), 1000))
    assert isinstance(refused, str)
    assert "the page is larger than" in refused and "vllm:lora_requests_info" in refused
    assert "a restart of the replica" in refused
