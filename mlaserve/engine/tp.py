"""Tensor-parallel ranks for the Engine: rank 0 is the engine's own process, ranks 1..N-1 are workers.

    workers = TPWorkers.start(config)      # spawns the workers, joins the process group as rank 0
    model = load_model(path, device, dtype, parallel=workers.parallel)
    workers.init_kv(num_pages)             # the workers build their KV pools and runners; waits for them
    runner = ModelRunner(..., tp_workers=workers)   # runner.run sends each step's StepInput first
    workers.shutdown()                     # stops and joins the workers (terminates stragglers)

Rank 0 runs the scheduler, sampler, detokenizer and the API; a worker runs only the model: it
receives each step's `StepInput` over its own pipe, builds its own layout and plans, and runs the
forward on its shard, meeting rank 0 in the all-reduces (gloo on the CPU, NCCL on CUDA, device
cuda:rank). Every rank holds the whole latent KV cache, written identically by every rank.

Steps go over pipes rather than a collective broadcast so that an idle worker can wait for the next
step indefinitely, while the collectives keep a timeout: a worker that dies makes rank 0's
next all-reduce (or its liveness check before each step) raise instead of hanging. A worker whose
parent dies sees its pipe close and exits.
"""

import datetime
import multiprocessing
import os
import socket
import traceback

import torch

from mlaserve.engine.config import EngineConfig
from mlaserve.models.parallel import ParallelConfig

COLLECTIVE_TIMEOUT_S = 300      # a collective that waits longer than this raises (a peer died or hung)
START_TIMEOUT_S = 600           # workers load the model: as long as rank 0 may take to load it


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank) if config.torch_device.type == "cuda" else torch.device("cpu")


def _process_group(config: EngineConfig, rank: int, port: int):
    """The ranks' ProcessGroup (no default group is created: several engines may live in one process)."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, config.tp_size, rank == 0,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    if config.torch_device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, config.tp_size, opts), store
    return dist.ProcessGroupGloo(store, rank, config.tp_size, timeout), store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    """Rank 0's handle on the worker ranks. `parallel` is rank 0's ParallelConfig."""

    def __init__(self, config: EngineConfig, procs, conns, parallel: ParallelConfig, store):
        self.config = config
        self.procs = procs
        self.conns = conns
        self.parallel = parallel
        self._store = store          # the rendezvous server lives in rank 0; keep it for the group's life
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig) -> "TPWorkers":
        if config.model_path is None:
            raise ValueError("tensor parallelism (tp_size > 1) needs EngineConfig.model_path: "
                             "each rank loads its shard")
        ctx = torch.multiprocessing.get_context("spawn")
        port = _free_port()
        procs, conns = [], []
        for rank in range(1, config.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, port, child), daemon=True,
                               name=f"mlaserve-tp{rank}")
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        workers = cls(config, procs, conns, None, None)
        try:
            group, store = _process_group(config, 0, port)
        except BaseException:
            workers.shutdown()
            raise
        workers.parallel = ParallelConfig(0, config.tp_size, group)
        workers._store = store
        return workers

    def init_kv(self, num_pages: int) -> None:
        """Workers build KV pools of num_pages and their runners; raises if one fails or times out."""
        for conn in self.conns:
            conn.send(("init", num_pages))
        for rank, conn in enumerate(self.conns, start=1):
            self._expect(rank, conn, "ready", START_TIMEOUT_S)

    def _expect(self, rank: int, conn, what: str, timeout: float) -> None:
        if not conn.poll(timeout):
            self.shutdown()
            raise RuntimeError(f"tensor-parallel rank {rank} did not report {what!r} within {timeout} s")
        try:
            msg = conn.recv()
        except EOFError:
            self.shutdown()
            raise RuntimeError(f"tensor-parallel rank {rank} exited (code {self.procs[rank - 1].exitcode})") from None
        if msg[0] != what:
            self.shutdown()
            raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{msg[1]}")

    def send_step(self, step) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if self._closed or not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} is not running (exit code {proc.exitcode})")
            conn.send(("step", step))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the workers; idempotent. A worker that does not stop within `timeout` s is terminated."""
        if self._closed:
            return
        self._closed = True
        for proc, conn in zip(self.procs, self.conns):
            if proc.is_alive():
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass     # it is exiting already; joined below either way
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
        for conn in self.conns:
            conn.close()


def _worker_main(config: EngineConfig, rank: int, port: int, conn) -> None:
    """A worker rank: load the shard, then run each step rank 0 sends until "stop" or rank 0 goes away."""
    try:
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
        group, _store = _process_group(config, rank, port)
        from mlaserve.engine.kv_pool import KVPool
        from mlaserve.engine.model_runner import ModelRunner
        from mlaserve.models import load_model
        model = load_model(config.model_path, device=device, dtype=config.torch_dtype,
                           parallel=ParallelConfig(rank, config.tp_size, group))
        msg = _recv(conn)
        if msg is None or msg[0] != "init":
            return
        kv_pool = KVPool(**model.kv_pool_spec(), num_pages=msg[1], page_size=config.page_size,
                         dtype=config.torch_dtype, device=device, kv_cache_dtype=config.kv_cache_dtype)
        runner = ModelRunner(model, kv_pool, config.attention_backend, config.nsa_prefill_backend,
                             config.nsa_decode_backend, config.kv_cache_dtype, device)
        conn.send(("ready",))
        while (msg := _recv(conn)) is not None and msg[0] == "step":
            runner.forward(msg[1])
    except BaseException:
        # rank 0 sees this in init_kv, or, mid-run, as the collective failing when this process exits
        text = traceback.format_exc()
        try:
            conn.send(("error", text))
        except (BrokenPipeError, OSError):
            pass     # rank 0 is gone; nobody to tell
        print(f"mlaserve tensor-parallel rank {rank} failed:\n{text}", flush=True)
        os._exit(1)


def _recv(conn):
    """The next message, or None once rank 0 has closed the pipe or died."""
    parent = multiprocessing.parent_process()
    while not conn.poll(1.0):
        if parent is not None and not parent.is_alive():
            return None
    try:
        return conn.recv()
    except EOFError:
        return None
