"""Lab probes: measurements a developer runs to find out where time goes, one question each.

    python -m bench.lab.overhead           # TTFT added by serving at 1 stream, variants interleaved
    python -m bench.lab.serve_floor        # Ray Serve's own TTFT on lmserve's topology, no model
    python -m bench.lab.turns              # HTTP targets in turns, each alone on the machine
    python -m bench.lab.chunked_prefill    # a long prompt arriving while other requests decode
    python -m bench.lab.soak               # twice the load lmserve can carry, then a health check
    python -m bench.lab.startup_and_single_stream   # `serve run` to first answer, then 1 stream
    python -m bench.lab.sglang_cpu_speed   # the real SGLang on CPU against the huggingface engine
    python -m bench.lab.decode_step        # one decode step of the batcher against the context length

They share `python -m bench`'s load generator, metrics and server handling (bench/loadgen.py,
bench/metrics.py, bench/servers.py, bench/targets.py). They print numbers; nothing here is a
test, and the product never imports them.

The GPU checks (`bash bench/gpu_check.sh`, `bash bench/gpu_check_sglang.sh`) sit in bench/ itself;
their requests are `bench.lab.gpu_check_requests`.
"""
