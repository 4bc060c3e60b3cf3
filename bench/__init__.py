"""lmserve against its peers: `python -m bench` (figures and how to run it: docs/performance.md).

- `__main__`: the command; runs each target under the same load and writes bench/results/.
- `targets`: what each target is and how it starts (lmserve, the in-process engine, the peers).
- `loadgen`: closed-loop streamed chat load over aiohttp (default) or httpx.
- `metrics`: what one streamed request recorded, and TTFT, ITL and tokens/s per level.
- `report`: the Markdown tables, the ratios against lmserve's targets, the plot.
- `servers`: servers started in process groups of their own and always stopped.
- `venvs`: the peers' virtual environments under bench/.venvs/.
- `inprocess`, `lmserve_server`: the child processes of the in-process and lmserve targets.
- `sampling`: `python -m bench.sampling`, time per sampling step, per-row against batched.
- `lab`: probes a developer runs to find out where time goes (`python -m bench.lab.<probe>`).

Benchmarks print numbers; tests never time anything.
"""
