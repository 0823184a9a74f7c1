"""Instant replicas and the C baseline for the benchmarks: nginx as a vLLM fleet, nginx
`proxy_pass`, and wrk closed loops. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .procs import Procs, pinned, wait_port

WRK_REPORT = r"""
done = function(summary, latency, requests)
  io.write(string.format(
    '\nWRKJSON {"requests": %d, "duration_us": %d, "errors": %d, "status_errors": %d, '
    .. '"timeouts": %d, "p50": %d, "p90": %d, "p99": %d, "bytes": %d}\n',
    summary.requests, summary.duration,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.errors.status, summary.errors.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), summary.bytes))
end
"""


def _start_nginx(procs: Procs, root: Path, http_body: str, cpus: str) -> subprocess.Popen[bytes]:
    """One single-worker nginx in the foreground, all its files under `root`."""
    (root / "logs").mkdir(parents=True, exist_ok=True)
    conf = f"""
daemon off;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {root}/nginx.pid;
error_log {root}/logs/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_buffer_size 1m;
  client_body_temp_path {root};
  proxy_temp_path {root};
  fastcgi_temp_path {root};
  uwsgi_temp_path {root};
  scgi_temp_path {root};
  keepalive_requests 1000000;
{http_body}}}
"""
    (root / "nginx.conf").write_text(conf)
    return procs.start(["nginx", "-p", str(root), "-c", str(root / "nginx.conf")], cpus=cpus)


def models_json(model: str) -> str:
    """`GET /v1/models` as vLLM answers it: the base model first, with its max_model_len."""
    card = {"id": model, "object": "model", "root": model, "max_model_len": 32768, "parent": None}
    return json.dumps({"object": "list", "data": [card]})


def server_info_json() -> str:
    """The part of vLLM's `GET /server_info` a router reads at start."""
    config = {
        "lora_config": {"max_lora_rank": 1, "max_loras": 6, "max_cpu_loras": 6},
        "cache_config": {"block_size": 16},
        "parallel_config": {"data_parallel_size": 1},
    }
    return json.dumps({"vllm_config": config})


def nginx_fleet(
    procs: Procs,
    ports: Sequence[int],
    model: str,
    body: str,
    content_type: str,
    cpus: str,
    metrics: bytes = b"",
) -> None:
    """One nginx that answers on every port of `ports` at once, like a vLLM server would: a
    fleet of instant replicas for the price of one process.

    Completions get `body` (a file, so long SSE replies fit); `/v1/models` and `/server_info`
    get enough of vLLM's shape for a router to start, `/metrics` gets `metrics`.
    """
    root = procs.tmp / f"nginx-fleet-{ports[0]}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "reply").write_text(body)
    (root / "models").write_text(models_json(model))
    (root / "server_info").write_text(server_info_json())
    (root / "metrics").write_bytes(metrics)
    listens = "".join(f"    listen 127.0.0.1:{port};\n" for port in ports)
    server = f"""
  server {{
{listens}    root {root};
    location = /health {{ return 200; }}
    location = /v1/models {{ default_type application/json; try_files /models =404; }}
    location = /server_info {{ default_type application/json; try_files /server_info =404; }}
    location = /metrics {{ default_type text/plain; try_files /metrics =404; }}
    # POSTs to a static file are 405 in nginx; turn them back into the file.
    location / {{
      default_type '{content_type}'; error_page 405 =200 /reply; try_files /reply =404;
    }}
    location = /reply {{ default_type '{content_type}'; internal; }}
  }}
"""
    _wait_nginx(procs, _start_nginx(procs, root, server, cpus), ports)


def _wait_nginx(procs: Procs, proc: subprocess.Popen[bytes], ports: Sequence[int]) -> None:
    try:
        for port in ports:
            wait_port(port)
    except RuntimeError as e:
        procs.stop(proc)
        raise RuntimeError(f"{e}; nginx said: {procs.log_tail(proc.pid)}") from None


def nginx_proxy(
    procs: Procs, port: int, upstreams: Sequence[int], cpus: str
) -> subprocess.Popen[bytes]:
    """nginx `proxy_pass` with keep-alive upstreams: the C baseline for proxy overhead."""
    root = procs.tmp / f"nginx-proxy-{port}"
    servers = "".join(f"server 127.0.0.1:{p};" for p in upstreams)
    server = f"""
  upstream replicas {{ {servers} keepalive 256; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 1h;
    }}
  }}
"""
    proc = _start_nginx(procs, root, server, cpus)
    _wait_nginx(procs, proc, [port])
    return proc


@dataclass
class WrkResult:
    requests: int
    seconds: float
    errors: int
    p50_us: int
    p90_us: int
    p99_us: int
    bytes: int
    timeouts: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def wrk(
    url: str,
    script: Path,
    *,
    connections: int,
    seconds: float,
    cpus: str | None = None,
) -> WrkResult:
    """A closed loop of `connections` clients (one wrk thread) running the Lua `script`
    against `url` for `seconds`; the script must end with `WRK_REPORT`."""
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",  # a loaded, shared machine can stall a reply past wrk's default of 2 s
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(pinned(argv, cpus), capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no report:\n{out[-2000:]}")
    data = json.loads(line[len("WRKJSON ") :])
    return WrkResult(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=data["errors"] + data["status_errors"],
        p50_us=data["p50"],
        p90_us=data["p90"],
        p99_us=data["p99"],
        bytes=data["bytes"],
        timeouts=data["timeouts"],
    )
