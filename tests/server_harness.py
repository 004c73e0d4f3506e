"""Starts the real server (`python -m mlaserve.server.launch`) in a subprocess on a free loopback
port and waits for /health. One server per configuration per test process (xdist worker), shared
by every test module that asks for it, stopped at exit.

The shared configuration serves the built-in model (built fresh into a temp cache, so its start
time includes the build) with a KV pool small enough that 64 concurrent requests must queue and
be preempted, a context length below the pool size, chunked prefill, and an API key.
"""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key-123"
PAGE_SIZE = 2                      # tiny pages: decoding requests grow by pages, so the pool runs dry
POOL_PAGES = 96                    # 192 tokens: a handful of requests at once
CONTEXT_LENGTH = 192                # = the pool: the longest request that fits
SHARED_ARGS = ["--page-size", str(PAGE_SIZE), "--max-total-tokens", str(POOL_PAGES * PAGE_SIZE),
               "--context-length", str(CONTEXT_LENGTH), "--chunked-prefill-size", "128",
               "--api-key", API_KEY, "--log-level", "warning"]
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    start_seconds: float           # process start to the first 200 from /health
    cache_dir: str
    log_path: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as metric name -> value, summed over label sets (counters by route, say)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{")[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.cache_dir, ignore_errors=True)


_servers: dict[tuple, Server] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "mlaserve.server.launch", *args]


def server_env(cache_dir: str) -> dict:
    # the repo first; keep what the caller had on the path (the device installs the server's packages there)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MLASERVE_CACHE=cache_dir, PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)
    return env


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if the test process dies without running its atexit hooks."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(args: list[str], timeout: float = 120.0) -> Server:
    cache_dir = tempfile.mkdtemp(prefix="mlaserve-test-cache-")
    port = free_port()
    log_path = os.path.join(cache_dir, "server.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launch_command([*args, "--host", "127.0.0.1", "--port", str(port)]),
                                env=server_env(cache_dir), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    server = Server(f"http://127.0.0.1:{port}", proc, 0.0, cache_dir, log_path)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.perf_counter() - start > timeout:
            server.stop()
            raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{server.log()}")
        time.sleep(0.2)
    server.start_seconds = time.perf_counter() - start
    return server


def shared_server(extra: tuple[str, ...] = ()) -> Server:
    """The shared server of this process (started on first use)."""
    key = tuple(SHARED_ARGS) + tuple(extra)
    if key not in _servers:
        _servers[key] = start_server(list(key))
    server = _servers[key]
    if server.proc.poll() is not None:
        raise RuntimeError(f"the shared server died:\n{server.log()}")
    return server


@atexit.register
def _stop_all() -> None:
    for server in _servers.values():
        server.stop()


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once no request runs or waits (and the latest engine step has been reported)."""
    deadline = time.perf_counter() + timeout
    while True:
        m = server.metrics()
        if m["mlaserve_num_running_reqs"] == 0 and m["mlaserve_num_waiting_reqs"] == 0:
            return m
        if time.perf_counter() > deadline:
            raise AssertionError(f"the server is still busy after {timeout} s: {m}")
        time.sleep(0.1)
