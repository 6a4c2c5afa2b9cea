"""Ray + Serve for HTTP tests: one local Ray, one Serve HTTP proxy on a free port, apps by route prefix."""
from __future__ import annotations

import socket
import time

import ray
from ray import serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve() -> int:
    port = free_port()
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"DLLM_SHARD_THREADS": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def stop_serve() -> None:
    serve.shutdown()
    ray.shutdown()


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
