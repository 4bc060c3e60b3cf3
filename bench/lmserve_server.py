"""Serve lmserve on a private local Ray cluster until SIGINT/SIGTERM; run by `python -m bench`.

    python -m bench.lmserve_server --port 8123 --ray-temp-dir /tmp/lmbench-1 --args '{"models": [...]}'

`ray.init(address="local")` starts a new cluster even when others run on this machine (other
engineers' tests), with its own temp dir, so the harness can find and stop every process of it;
HTTP listens on 127.0.0.1 only (with HAProxy, on every interface: Ray ignores the host then).
`--args` is `build_app`'s `args` (serve_config.yaml's). The cluster runs in Ray Serve's
high-throughput mode, as `lmserve serve` starts it (deployments.cluster.env.RAY_HIGH_THROUGHPUT_ENV).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lmserve_server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--args", required=True, help="build_app args, JSON")
    parser.add_argument("--ray-temp-dir", required=True)
    parser.add_argument("--num-cpus", type=int, default=2)
    opts = parser.parse_args()

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    from deployments.cluster.env import apply_ray_high_throughput_env, second_cluster_ports_env

    apply_ray_high_throughput_env()  # as `lmserve serve` (`RAY_SERVE_ENABLE_HA_PROXY=0` etc. turn it off)
    for name, value in second_cluster_ports_env(avoid=[opts.port]).items():  # other clusters may run on this machine
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    from deployments.app import build_app

    ray.init(address="local", num_cpus=opts.num_cpus, include_dashboard=False, _temp_dir=opts.ray_temp_dir)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": opts.port})
        serve.run(build_app(json.loads(opts.args)), name="lmserve", route_prefix="/")
        print(f"lmserve ready on 127.0.0.1:{opts.port}", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
