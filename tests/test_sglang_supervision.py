"""Supervision of the SGLang server child process with programs that fail to become a server
(no model is loaded): start-up failure, readiness time-out, refused flags, no orphan left."""

import asyncio
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import group_exists
from engines.config import EngineConfig
from engines.errors import ModelLoadError
from engines.sglang.engine import SGLangEngine
from real_sglang import launch_command

STANDIN = Path(__file__).parent / "standins" / "sglang_server.py"


@pytest.fixture
def model_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    return tmp_path


def engine_with(command, model_path, **fields) -> SGLangEngine:
    return SGLangEngine(EngineConfig(infer_backend="sglang", model_name_or_path=str(model_path),
                                     sglang_launch_command=command, **fields))


def test_exit_during_start_up_quotes_the_last_lines(model_path):
    script = ("import sys; print('loading weights'); "
              "print('RuntimeError: No CUDA GPUs are available', file=sys.stderr); sys.exit(3)")
    engine = engine_with([sys.executable, "-c", script], model_path)
    with pytest.raises(ModelLoadError) as info:
        asyncio.run(engine.start())
    assert "sglang server exited with status 3 during start-up" in info.value.message
    assert "loading weights" in info.value.message and "No CUDA GPUs are available" in info.value.message


def test_readiness_time_out_names_the_limit_and_leaves_no_process(model_path, caplog):
    # Ignores SIGTERM and has a child of its own, like SGLang's scheduler: both must go.
    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("capturing cuda graphs", flush=True)
        time.sleep(600)
    """)
    engine = engine_with([sys.executable, "-c", script], model_path, sglang_start_timeout_s=1.5)
    engine.stop_grace_s = 1
    caplog.set_level(logging.INFO, logger="engines.sglang.server_process")
    with pytest.raises(ModelLoadError) as info:
        asyncio.run(engine.start())
    assert "not ready after 1.5 s" in info.value.message and "capturing cuda graphs" in info.value.message
    assert not group_exists(engine.server.pgid)
    # the child's output went to this process's log, and the API key did not
    forwarded = [r.getMessage() for r in caplog.records if r.name == "engines.sglang.server_process.sglang"]
    assert any("capturing cuda graphs" in m for m in forwarded)
    started = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("starting sglang"))
    # (`--api-key=***` where the random key starts with "-")
    assert "--api-key '***'" in started or "'--api-key=***'" in started, started


@pytest.mark.parametrize("server", ["standin", pytest.param("real", marks=[pytest.mark.slow, pytest.mark.real_sglang,
                                                                          pytest.mark.extended])])
def test_unknown_flags_are_refused_by_the_server(model_path, server, request):
    """The stand-in refuses them as SGLang 0.5.23's argparse does (status 2, its message)."""
    command = ([sys.executable, str(STANDIN)] if server == "standin"
               else launch_command(request.getfixturevalue("real_sglang_python")))
    engine = engine_with(command, model_path, sglang_config={"no_such_flag": 1})
    with pytest.raises(ModelLoadError) as info:
        asyncio.run(engine.start())
    assert "exited with status 2" in info.value.message
    assert "unrecognized arguments: --no-such-flag 1" in info.value.message


def test_a_missing_program_is_a_clear_error(model_path):
    engine = engine_with(["/nonexistent/python", "-m", "sglang.launch_server"], model_path)
    with pytest.raises(ModelLoadError, match="cannot execute '/nonexistent/python'"):
        asyncio.run(engine.start())


def test_a_replica_killed_outright_takes_its_server_with_it(tmp_path):
    # A stand-in for a replica process that is SIGKILLed (no shutdown runs): its server child,
    # in a process group of its own, must not outlive it.
    replica = textwrap.dedent("""
        import asyncio, sys, time
        from engines.sglang.server_process import ServerProcess
        async def main():
            server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], "sleeper")
            await server.start()
            print(server.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", replica], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert group_exists(child)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while group_exists(child):
            assert time.monotonic() < deadline, "the server outlived its replica"
            time.sleep(0.1)
    finally:
        proc.kill()


def test_a_second_stop_signals_nothing(monkeypatch):
    """Once its group is gone, the group's id may be another process group's: a second `stop`
    (an engine shut down twice, as after a failed start) must not signal it."""
    import engines.sglang.server_process as server_process

    async def start_and_stop_twice():
        server = server_process.ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], "sleeper")
        await server.start()
        await server.stop(1)
        signals = []
        monkeypatch.setattr(server_process, "_signal_group", lambda pgid, sig: signals.append((pgid, sig)))
        await server.stop(1)
        return signals

    assert asyncio.run(start_and_stop_twice()) == []


def test_an_api_key_that_starts_with_a_dash_is_one_argument(model_path):
    """The replica's key is drawn from the URL-safe alphabet, "-" included: argparse took a key
    such as "-Xy..." for a flag and the server exited ("--api-key: expected one argument")."""
    from engines.sglang.server_process import ServerProcess
    from engines.sglang.launch import launch_arguments

    sys.path.insert(0, str(STANDIN.parent))
    from sglang_server import parse_args  # the stand-in's parser: SGLang's flags, by argparse

    argv = launch_arguments(EngineConfig(infer_backend="sglang"), model_path, port=1, api_key="-k3y", max_len=4096)
    assert "--api-key=-k3y" in argv and parse_args(argv).api_key == "-k3y"
    server = ServerProcess(["python", *argv], "sglang", secrets=("-k3y",))
    assert "--api-key=***" in server._masked(" ".join(server.command)) and "-k3y" not in server._masked("-k3y")
