"""perf profile of one lora-router tree at concurrency 64, siblings trace, 2 replicas.

The setup of bench/overhead.py (its nginx replicas, TRL payload and wrk script, the router
pinned to core 0): 2 s of warm-up, then `perf record -F 1999 -g` of the router's process for
4 s of a 5 s wrk window. Then, e.g.:

    python bench/results/archive/compiled/perf_profile.py /tmp/compiled-c /tmp/compiled.data
    perf report -i /tmp/compiled.data --no-children --sort dso -g none
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/
from lib import overhead_setup as overhead
from lib.nginx import wrk
from lib.procs import Procs, free_port, wait_port


def main(tree: str, out: str) -> None:
    procs = Procs()
    try:
        ports = overhead.start_fleet(procs, 2)
        port = free_port()
        proc = overhead.lora_router_from(tree)(procs, port, ports)
        assert proc is not None
        wait_port(port)
        script = overhead.lua_script(
            Path(tempfile.mkdtemp()), overhead.Payload.make(512), overhead.GROUP
        )
        url = f"http://127.0.0.1:{port}/v1/completions"
        wrk(url, script, connections=64, seconds=2, cpus=overhead.LOAD_CPU)
        record = ["perf", "record", "-F", "1999", "-g", "-o", out, "-p", str(proc.pid)]
        rec = subprocess.Popen(
            [*record, "--", "sleep", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        result = wrk(url, script, connections=64, seconds=5, cpus=overhead.LOAD_CPU)
        rec.wait()
        print(f"{tree}: {result.rps:.0f} req/s while recorded")
    finally:
        procs.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
