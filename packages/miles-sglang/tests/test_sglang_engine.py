"""The SGLang launcher without SGLang: flag pass-through, the command line, the install error,
and the process-tree lifecycle with a real stand-in server process."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from miles.backends.sglang_utils.router import running_router
from miles.backends.sglang_utils.server_process import ServerStartError, free_port
from miles.backends.sglang_utils.sglang_engine import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangUnavailableError,
    build_launch_command,
    require_sglang,
)
from miles.backends.sglang_utils.sglang_flags import sglang_args_from_cli
from miles.backends.training_utils.infra.device import get_device_info

# Stands in for `python -m sglang.launch_server`: spawns a child (as SGLang spawns its scheduler
# and detokenizer), records both pids, then serves /health and /health_generate after a delay.
STAND_IN_SERVER = textwrap.dedent(
    """
    import http.server, json, os, signal, subprocess, sys, time

    port, pid_file, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    child_code = "import signal, time; {} time.sleep(600)".format(
        "signal.signal(signal.SIGTERM, signal.SIG_IGN);" if mode == "stubborn" else ""
    )
    child = subprocess.Popen([sys.executable, "-c", child_code])
    with open(pid_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    print("stand-in: devices", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    print("stand-in: loading weights", flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA out of memory (stand-in)", flush=True)
        sys.exit(3)
    ready_at = time.monotonic() + 0.5

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = mode != "never" and time.monotonic() >= ready_at
            self.send_response(200 if ready and self.path.startswith("/health") else 503)
            self.end_headers()

        def do_POST(self):
            body = json.dumps({"text": "stand-in", "output_ids": [1], "meta_info": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie may wait for a container init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _stand_in_engine(tmp_path: Path, mode: str, timeout_s: float = 20.0, **config: object):
    port = free_port()
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN_SERVER)
    pid_file = tmp_path / "pids"
    command = [sys.executable, str(script), str(port), str(pid_file), mode]
    settings = SGLangEngineConfig(
        model_path="stand-in", port=port, startup_timeout_s=timeout_s, **config
    )
    engine = SGLangEngine(settings, launch_command=command, log_path=tmp_path / "server.log")
    return engine, pid_file


def _pids(pid_file: Path) -> list[int]:
    return [int(pid) for pid in pid_file.read_text().split()]


def test_sglang_flags_are_split_from_the_rest_of_the_command_line():
    argv = [
        "--rollout-batch-size", "8",
        "--sglang-context-length", "4096",
        "--sglang-enable-torch-compile",
        "--lr", "1e-6",
        "--sglang-cuda-graph-bs", "1", "2", "4",
        "--sglang-log-level=warning",
        "--sglang-router-port", "3000",
        "--sglang-schedule_conservativeness", "-0.5",
        "--", "--sglang-after-dashdash",
    ]  # fmt: skip
    flags, rest = sglang_args_from_cli(argv, miles_flags={"--sglang-router-port"})
    assert flags == {
        "context-length": "4096",
        "enable-torch-compile": True,
        "cuda-graph-bs": ["1", "2", "4"],
        "log-level": "warning",
        "schedule-conservativeness": "-0.5",
    }
    assert rest == [
        "--rollout-batch-size", "8", "--lr", "1e-6", "--sglang-router-port", "3000",
        "--", "--sglang-after-dashdash",
    ]  # fmt: skip


def test_a_repeated_sglang_flag_is_an_error():
    with pytest.raises(ValueError, match="--sglang-dtype is given twice"):
        sglang_args_from_cli(["--sglang-dtype", "half", "--sglang-dtype", "float"])


def test_launch_command_has_the_owned_flags_then_the_passed_through_ones():
    config = SGLangEngineConfig(
        model_path="/ckpt",
        port=31000,
        tp_size=2,
        mem_fraction_static=0.7,
        dtype="bfloat16",
        random_seed=1,
        extra_args={"enable-torch-compile": True, "disable-radix-cache": False,
                    "cuda-graph-bs": ["1", "2"], "context-length": "4096"},
    )  # fmt: skip
    assert build_launch_command(config, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/ckpt",
        "--host", "127.0.0.1", "--port", "31000", "--tp-size", "2", "--dtype", "bfloat16",
        "--mem-fraction-static", "0.7", "--random-seed", "1",
        "--enable-torch-compile", "--cuda-graph-bs", "1", "2", "--context-length", "4096",
    ]  # fmt: skip


def test_a_passed_through_flag_may_not_shadow_a_config_field():
    with pytest.raises(ValueError, match=r"--sglang-tp \(4\).*tp_size.*drop --sglang-tp"):
        SGLangEngineConfig(model_path="/ckpt", extra_args={"tp": "4"})
    with pytest.raises(ValueError, match=r"mem_fraction_static \(1.5\)"):
        SGLangEngineConfig(model_path="/ckpt", mem_fraction_static=1.5)


@pytest.fixture
def cpu_device(monkeypatch):
    monkeypatch.setenv("MILES_DEVICE", "cpu")
    get_device_info.cache_clear()
    yield
    get_device_info.cache_clear()


def test_missing_sglang_is_a_one_line_import_error_naming_the_extra(cpu_device, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sglang" else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError) as info:
        require_sglang()
    assert isinstance(info.value, SGLangUnavailableError)
    message = str(info.value)
    assert "\n" not in message
    assert "uv pip install 'miles-sglang[sglang]'" in message
    assert "--rollout-engine reference" in message and "sglang not installed" in message


def test_sglang_on_a_cpu_machine_is_refused(cpu_device, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    with pytest.raises(SGLangUnavailableError, match="device cpu"):
        require_sglang()


def test_starting_the_real_engine_without_sglang_launches_nothing(cpu_device, tmp_path):
    engine = SGLangEngine(SGLangEngineConfig(model_path="/ckpt", port=free_port()))
    with pytest.raises(SGLangUnavailableError):
        engine.start()
    engine.shutdown()  # nothing to stop: must not raise


def test_start_waits_for_health_and_shutdown_kills_the_whole_tree(tmp_path):
    engine, pid_file = _stand_in_engine(tmp_path, "ok")
    engine.start()
    try:
        assert engine.client.health_generate() is True
        server_pid, child_pid = _pids(pid_file)
        assert _alive(server_pid) and _alive(child_pid)
    finally:
        engine.shutdown()
    assert not _alive(server_pid) and not _alive(child_pid)
    engine.shutdown()  # idempotent


def test_the_server_sees_exactly_the_gpus_of_its_bundles(tmp_path, monkeypatch):
    # A Ray actor sees only its own bundle's GPU; a two-GPU engine is shown both of its GPUs.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    engine, _ = _stand_in_engine(tmp_path, "ok", tp_size=2, visible_devices=["3", "5"])
    engine.start()
    try:
        assert "stand-in: devices 3,5" in (tmp_path / "server.log").read_text()
    finally:
        engine.shutdown()


def test_visible_devices_must_give_each_tensor_parallel_rank_one_gpu():
    with pytest.raises(ValueError, match=r"visible_devices \['3'\] names 1 GPU\(s\) for tp_size 2"):
        SGLangEngineConfig(model_path="m", tp_size=2, visible_devices=["3"])


def test_an_engine_launch_spec_names_one_device_per_engine_device():
    from miles.backends.sglang_utils.engine_launcher import EngineLaunchSpec

    assert EngineLaunchSpec(model_path="m", num_devices=2, visible_devices=["0", "1"])
    with pytest.raises(ValueError, match=r"names 1 device\(s\) for an engine of 2"):
        EngineLaunchSpec(model_path="m", num_devices=2, visible_devices=["0"])


def test_a_server_that_exits_fails_fast_with_its_last_log_lines(tmp_path):
    engine, pid_file = _stand_in_engine(tmp_path, "crash", timeout_s=60)
    start = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        engine.start()
    assert time.monotonic() - start < 10, "must not wait for the 60 s timeout"
    assert "exited with code 3" in str(info.value)
    assert "CUDA out of memory (stand-in)" in str(info.value)
    assert not any(_alive(pid) for pid in _pids(pid_file)), "its orphaned child must be killed"


def test_a_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    engine, pid_file = _stand_in_engine(tmp_path, "never", timeout_s=1.5)
    with pytest.raises(ServerStartError, match=r"did not answer .*/health_generate within 2 s"):
        engine.start()
    assert not any(_alive(pid) for pid in _pids(pid_file))


def test_shutdown_escalates_to_sigkill_for_a_child_that_ignores_sigterm(tmp_path):
    engine, pid_file = _stand_in_engine(tmp_path, "stubborn")
    engine.start()
    _, child_pid = _pids(pid_file)
    start = time.monotonic()
    engine.shutdown(grace_s=0.5)
    assert not _alive(child_pid)
    assert time.monotonic() - start < 5


def test_engine_registers_with_a_router_and_leaves_it_on_shutdown(tmp_path):
    engine, pid_file = _stand_in_engine(tmp_path, "ok")
    with running_router([], log_path=tmp_path / "router.log") as router:
        engine.start()
        try:
            engine.register_with_router(router.url)
            assert router.workers() == [engine.url]
            answer = httpx.post(f"{router.url}/generate", json={"input_ids": [1]}, timeout=10)
            assert answer.json()["text"] == "stand-in"
        finally:
            engine.shutdown()
        assert router.workers() == []
    assert not any(_alive(pid) for pid in _pids(pid_file))
    assert os.path.exists(tmp_path / "server.log")
