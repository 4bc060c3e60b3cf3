"""`python -m bench.lab.structured_output_step`: its step measurement (the probe itself is a benchmark)."""

import pytest

from bench.lab.structured_output_step import step_costs

pytestmark = pytest.mark.bench  # a lab probe's test: run with --run-bench


@pytest.mark.slow  # runs the real default model
def test_step_costs_time_plain_and_constrained_steps(hf_engine, renderer):
    cost = step_costs(hf_engine, renderer, rows=2, steps=2)
    assert set(cost) == {"plain", "constrained", "grammar"} and 0 < cost["grammar"] < cost["constrained"]
