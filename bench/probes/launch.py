"""lora_router.cli with counters: on SIGUSR1 it appends one JSON line to $PROBE_OUT (getrusage's
user and system time, minor faults, context switches; resident pages; the cycle collector's
collections and time per generation, from `gc.callbacks`). Used by bench/probes/fresh.py."""

import gc
import json
import os
import resource
import runpy
import signal
import sys
import time

stats: dict[str, list[int]] = {"n": [0, 0, 0], "ns": [0, 0, 0]}
began = [0]


def on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        began[0] = time.perf_counter_ns()
    else:
        stats["n"][info["generation"]] += 1
        stats["ns"][info["generation"]] += time.perf_counter_ns() - began[0]


def dump(sig: int, frame: object) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss_pages = int(f.read().split()[1])
    line = {
        "utime": ru.ru_utime,
        "stime": ru.ru_stime,
        "minflt": ru.ru_minflt,
        "nvcsw": ru.ru_nvcsw,
        "nivcsw": ru.ru_nivcsw,
        "rss_pages": rss_pages,
        "gc": {k: list(v) for k, v in stats.items()},
    }
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps(line) + "\n")


gc.callbacks.append(on_gc)
signal.signal(signal.SIGUSR1, dump)
sys.argv = ["lora_router.cli", *sys.argv[1:]]
runpy.run_module("lora_router.cli", run_name="__main__", alter_sys=True)
