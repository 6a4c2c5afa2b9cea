"""`make serve`: a local Ray with Serve on 127.0.0.1, serving the default model or a checkpoint.

    python scripts/serve_local.py [model=DIR] [tp=N] [port=P] [FIELD=VALUE ...]

FIELD is any argument of deployments/args.py:AppArgs (`tp` is short for tensor_parallel_size); the
environment variables MODEL, TP and PORT give the same settings, arguments win. It builds the app from
what Ray has, loads the weights before printing the ready message and curl examples, and on Ctrl-C or
SIGTERM shuts Serve and Ray down in whatever state they are. SIGUSR1 prints every thread's Python stack
to stderr (where a stop that does not end is stuck).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for deployments/

APP = "dllm"
ALIASES = {"tp": "tensor_parallel_size"}


def parse(argv: list[str], env: dict[str, str]) -> tuple[dict, int]:
    """(build_app's args, the HTTP port) from `key=value` arguments over the MODEL/TP/PORT environment."""
    settings = {"model": env.get("MODEL"), "tp": env.get("TP"), "port": env.get("PORT")}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or not key or not value:
            sys.exit(f"serve_local: expected key=value, got {arg!r}\n\n{__doc__}")
        settings[key.lower()] = value
    port = int(settings.pop("port") or 8000)
    args = {ALIASES.get(k, k): v for k, v in settings.items() if v}  # unset or empty: AppArgs' default
    return args, port


def curl_examples(base: str, model: str, api_key: str | None) -> str:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    # prompts the default model (trained on the standard library's docstrings) answers in words
    completion = {"model": model, "prompt": "Return the number of items in the", "max_tokens": 32, "logprobs": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "What does os.path.join do?"}],
            "max_completion_tokens": 32,
            "logprobs": True, "top_logprobs": 2, "diffusion": {"policy": "threshold", "threshold": 0.9}}
    return "\n".join(f"  curl {base}/v1/{path} -H 'Content-Type: application/json'{auth} \\\n"
                     f"    -d '{json.dumps(body)}'"
                     for path, body in (("completions", completion), ("chat/completions", chat)))


def _terminate(signum, frame):
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both mean a clean shutdown, even where SIGINT was inherited as ignored (a
    background job of a non-interactive shell) or either was inherited blocked."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _defer_signals() -> list[int]:
    """Ctrl-C and SIGTERM noted, not raised, while ray.init forks Ray's processes: a KeyboardInterrupt
    raised inside a fork's after-fork hook (logging's, which releases its module lock) is swallowed by
    the interpreter with that lock still held, and every other thread that logs then waits forever (the
    router's, which serve.shutdown waits on). The caller raises it once ray.init returns."""
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    return caught


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    args, port = parse(argv, dict(os.environ))

    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.args import AppArgs
    from workers.coordinator import describe_warm_up

    started = time.monotonic()
    resolved = AppArgs(**args)  # a pydantic error names a bad argument before Ray starts
    _stop_on_signals()
    try:
        # Every state ends the same way on Ctrl-C: Ray starting, the app deploying (weights loading,
        # placement pending), serving.
        print("starting Ray ...", flush=True)
        caught = _defer_signals()
        ray.init()   # a local Ray on this machine (or, with RAY_ADDRESS, the cluster there)
        _stop_on_signals()   # again: ray.init installs its own SIGTERM handler
        if caught:   # a Ctrl-C (or SIGTERM) while Ray started
            raise KeyboardInterrupt
        app = build_app(args)  # the device and the placement from the cluster Ray now has
        print("deploying ...", flush=True)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=APP, route_prefix="/")
        # serve.run returns once every replica runs: the shards have loaded and warmed up (captures, compiles)
        stats = serve.get_deployment_handle("Coordinator", app_name=APP).stats.remote().result(timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        warm = f"\nwarm-up: {describe_warm_up(stats['warm_up'])}" if stats["warm_up"].get("graphs") else ""
        print(f"\ndllm-serve is ready on {base} after {time.monotonic() - started:.1f} s: model "
              f"`{resolved.model_name()}` ({resolved.model_dir()}), tensor_parallel_size={resolved.tensor_parallel_size}"
              f", a KV cache of {stats['kv_cache_tokens']} tokens{warm}\n\n"
              f"{curl_examples(base, resolved.model_name(), resolved.api_key)}\n\n"
              f"  curl {base}/v1/models\n\nCtrl-C to stop.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping dllm-serve ...", flush=True)
    except (ValueError, RuntimeError) as err:  # a deploy error: the cluster cannot hold it, a failed start
        print(f"\ndllm-serve could not start: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            if ray.is_initialized():
                serve.shutdown()  # bounded by Serve (30 s)
        except KeyboardInterrupt:  # a second Ctrl-C skips the graceful part
            pass
        ray.shutdown()  # stops the local Ray this script started (with RAY_ADDRESS: disconnects)


if __name__ == "__main__":
    main(sys.argv[1:])
