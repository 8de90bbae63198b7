"""wsync's agents beside Ray actors: for RL frameworks that place their trainer and rollout workers
with Ray (verl, OpenRLHF, slime, NeMo-RL, SkyRL). No host list, no address written by hand: every
agent is placed from the actor it serves, and every address is found through Ray.

    from wsync.ray import TrainerAgents, RolloutAgents, rollout_agent_address

    trainer = TrainerAgents(trainer_actors, source="dir:/ckpt/megatron")   # or "shm:NAME"
    coordinator = trainer.start()            # one agent per actor, rank order = the actors' order
    rollout = RolloutAgents(engine_actors, coordinator, group="rollout")
    rollout.start()                          # one agent per engine rank actor
    # each engine actor, in its own process, then serves with its agent:
    #     agent = rollout_agent_address("rollout", index)     (blocks until the agent listens)
    ...
    rollout.stop(); trainer.stop()

Placement: each agent runs in a host actor (``num_cpus=0``) on its actor's node: in the actor's
placement-group bundle where the actor has one (the group's first bundle on that node), else
pinned to the node (by its id: a restarted node is a new one, so there it does not come back).
The host actor starts the agent binary (``bin_dir``, default ``$WSYNC_BIN``, else ``PATH``) as a
child that dies with it, and keeps its log (``log_dir`` on that node).

Addresses: trainer rank 0's node serves the coordinator and the store through which the trainer
agents form their world (``wsync-trainer-agent --world-size N --rank R --world-store``), on ports
picked free there; the other ranks and every rollout agent dial them. Each rollout agent listens
on its node's address, on one port for its life; its engine finds it by the host actor's name.

Lifecycle (Ray's): the host actors restart with their node (``max_restarts=-1``), in their bundle.
- A rollout agent that exits is started again on its port; a host actor Ray restarted starts it
  afresh: it joins the coordinator again and its engine catches up (docs/sync.md, "Versions").
- The trainer agents are one job, as under mpirun: when one exits or its host actor restarts, a
  watcher thread in the driver stops them all and starts them again with the same command; rank 0
  resumes from its durable state (``state_dir``), the rollout agents reconnect on their own.
- ``stop()`` (or the end of the driver: the host actors end with their job) ends every agent.
- A failure to start raises AgentStartError naming the node, the agent and the reason (its log).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

__all__ = ["AgentStartError", "TrainerAgents", "RolloutAgents", "rollout_agent_address"]


class AgentStartError(RuntimeError):
    """An agent did not start: ``node`` (its node's address), ``agent`` and the reason."""

    def __init__(self, node: str, agent: str, reason: str) -> None:
        self.node, self.agent, self.reason = node, agent, reason
        super().__init__(f"{agent} on node {node}: {reason}")

    def __reduce__(self) -> tuple:  # raised in a host actor, re-raised in the driver
        return (AgentStartError, (self.node, self.agent, self.reason))


def _where(self: object) -> Dict[str, Optional[str]]:  # runs inside the user's actor (__ray_call__)
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
            "pg": ctx.get_placement_group_id()}


def _placement(where: Dict[str, Optional[str]]) -> dict:
    """The scheduling strategy that puts a host actor where an actor is: its bundle, else its node."""
    if where["pg"]:
        table = placement_group_table(PlacementGroup(PlacementGroupID(bytes.fromhex(where["pg"]))))
        for index, node in sorted(table.get("bundles_to_node_id", {}).items()):
            if node == where["node_id"]:
                return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    PlacementGroup(PlacementGroupID(bytes.fromhex(where["pg"]))),
                    placement_group_bundle_index=int(index))}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(where["node_id"], soft=False)}


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: no dlopen in a forked child


def _die_with_parent() -> None:  # in the agent, before exec: SIGKILL when its host actor goes
    _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the host died before prctl took effect
        os._exit(1)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=8)
class _AgentHost:
    """One agent process on this node. `argv` may hold {ip} (this node's address) and {port} (the
    agent's port: 0 until its first address file, then kept). keep_running: start at once, and again
    whenever the agent exits (rollout agents); else only on start() (trainer agents)."""

    def __init__(self, name: str, argv: List[str], log_dir: str, keep_running: bool) -> None:
        self.name, self.argv, self.keep_running = name, list(argv), keep_running
        self.incarnation = uuid.uuid4().hex
        self.ip = ray.util.get_node_ip_address()
        self.dir = pathlib.Path(log_dir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self.stopping = False
        self.failures = 0  # agent exits in a row without an address (rollout agents: the respawn backoff)
        # Every spawn happens on one thread that lives as long as this actor: the agent's
        # PR_SET_PDEATHSIG follows the thread that started it.
        self.requests: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._loop, name="wsync-agent-host", daemon=True).start()
        if keep_running:
            self.start()

    def _loop(self) -> None:
        next_respawn = 0.0
        while True:
            try:
                argv, done, error = self.requests.get(timeout=0.5)
            except queue.Empty:
                argv, done, error = None, None, []
            with self.lock:
                if done is not None:
                    if argv is not None:
                        self.argv = list(argv)
                    self.stopping = False
                    try:
                        self._spawn()
                        done.set()
                    except Exception as e:  # noqa: BLE001 - handed to the caller of start()
                        error.append(AgentStartError(self.ip, self.name, f"cannot start {self.argv[:1]}: {e}"))
                        done.set()
                elif (self.keep_running and not self.stopping and self.proc is not None and self.proc.poll() is not None
                      and time.time() >= next_respawn):
                    # Started again on its port; an agent that keeps failing, less and less often (up to 30 s).
                    self.failures = 0 if (self.dir / "address").exists() else self.failures + 1
                    next_respawn = time.time() + min(30.0, 0.5 * 2 ** min(self.failures, 6))
                    try:
                        self._spawn()
                    except Exception as e:  # noqa: BLE001 - logged, tried again after the backoff
                        with open(self.dir / "log", "a") as log:
                            log.write(f"== cannot start the agent again: {e}\n")

    def _spawn(self) -> None:
        address = self.dir / "address"
        if address.exists():
            port = address.read_text().strip().rpartition(":")[2]
            self.port = int(port) if port.isdigit() else self.port
            address.unlink()
        argv = [a.replace("{ip}", self.ip).replace("{port}", str(self.port)).replace("{dir}", str(self.dir))
                for a in self.argv]
        with open(self.dir / "log", "ab") as log:
            log.write(f"== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)

    def start(self, argv: Optional[List[str]] = None) -> None:
        """Starts the agent (with `argv`, else the last one); AgentStartError if it cannot be."""
        done, error = threading.Event(), []  # type: Tuple[threading.Event, List[BaseException]]
        self.requests.put((argv, done, error))
        done.wait()
        if error:
            raise error[0]

    def free_ports(self, n: int) -> List[int]:
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind((self.ip, 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports

    def info(self) -> dict:
        with self.lock:
            rc = None if self.proc is None else self.proc.poll()
            return {"ip": self.ip, "incarnation": self.incarnation, "pid": None if self.proc is None else self.proc.pid,
                    "running": self.proc is not None and rc is None,
                    "returncode": rc, "log": str(self.dir / "log"), "tail": self._tail()}

    def _tail(self, lines: int = 12) -> str:
        try:
            with open(self.dir / "log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def address(self, timeout: float = 120.0) -> str:
        """The agent's bound address (its --address-file), once it is written."""
        deadline = time.time() + timeout
        path = self.dir / "address"
        while time.time() < deadline:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            with self.lock:
                rc = None if self.proc is None else self.proc.poll()
            if rc is not None and not self.keep_running:
                raise AgentStartError(self.ip, self.name,
                                      f"exited with {rc} before listening; its log ends:\n{self._tail()}")
            time.sleep(0.1)
        raise AgentStartError(self.ip, self.name, f"not listening after {timeout:.0f} s; its log ends:\n{self._tail()}")

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        with self.lock:
            self.stopping = True
            if self.proc is None:
                return None
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            (self.dir / "address").unlink(missing_ok=True)
            return self.proc.returncode


def _binary(bin_dir: Optional[str], name: str) -> str:
    d = bin_dir or os.environ.get("WSYNC_BIN")
    if d:
        return str(pathlib.Path(d) / name)
    return shutil.which(name) or name


def _security(token_file: Optional[str]) -> List[str]:
    return ["--token-file", token_file] if token_file else []


class _Group:
    def __init__(self, actors: Sequence, kind: str, log_dir: Optional[str]) -> None:
        if not actors:
            raise ValueError(f"{kind}: no actors")
        self.actors = list(actors)
        self.kind = kind
        self.log_dir = log_dir or f"/tmp/wsync-ray/{uuid.uuid4().hex[:8]}"
        self.hosts: List = []
        self.nodes: List[dict] = []

    def _place(self, name: Callable[[int], str], argv: Callable[[int], List[str]], keep_running: bool,
               lifetime_name: Callable[[int], Optional[str]] = lambda i: None) -> None:
        self.nodes = ray.get([a.__ray_call__.remote(_where) for a in self.actors])
        self.hosts = []
        for i, where in enumerate(self.nodes):
            opts = _placement(where)
            if lifetime_name(i):
                opts["name"] = lifetime_name(i)
            host = _AgentHost.options(**opts)  # type: ignore[attr-defined]
            self.hosts.append(host.remote(name(i), argv(i), self.log_dir, keep_running))

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every agent (SIGTERM, then SIGKILL after 10 s) and its host actor."""
        hosts, self.hosts = self.hosts, []
        try:
            if hosts:
                ray.get([h.stop.remote() for h in hosts], timeout=timeout)
        finally:
            for h in hosts:
                ray.kill(h, no_restart=True)  # the agents die with their host (PR_SET_PDEATHSIG)


class TrainerAgents(_Group):
    """One wsync-trainer-agent per trainer actor (rank r = actors[r]); rank 0 hosts the coordinator.

    source: "dir:PATH" or "shm:NAME" for every rank, or a function of the rank. args: more
    wsync-trainer-agent flags (--delivery, --quant-config, --backend ...). state_dir: rank 0's
    durable state (relative paths are under log_dir on rank 0's node)."""

    def __init__(self, actors: Sequence, source: Union[str, Callable[[int], str]], *, bin_dir: Optional[str] = None,
                 args: Sequence[str] = (), token_file: Optional[str] = None, log_dir: Optional[str] = None,
                 state_dir: str = "state", join_timeout: float = 120.0, watch: bool = True) -> None:
        super().__init__(actors, "TrainerAgents", log_dir)
        fixed = source if isinstance(source, str) else ""
        self.source: Callable[[int], str] = (lambda rank: fixed) if isinstance(source, str) else source
        self.bin = _binary(bin_dir, "wsync-trainer-agent")
        self.args, self.token_file, self.state_dir = list(args), token_file, state_dir
        self.join_timeout, self.watch = join_timeout, watch
        self.coordinator: Optional[str] = None
        self.restarts = 0  # completed restarts of the trainer agents (the watcher's)
        self.last_error: Optional[BaseException] = None  # the watcher's last failed restart
        self._incarnations: List[str] = []
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None

    def _argv(self, rank: int, store: str, coordinator: str) -> List[str]:
        state = self.state_dir if os.path.isabs(self.state_dir) else str(pathlib.Path(self.log_dir) / self.state_dir)
        return [self.bin, "--source", self.source(rank), "--world-size", str(len(self.actors)), "--rank", str(rank),
                "--world-store", store, "--world-join-timeout", str(self.join_timeout), "--coordinator", coordinator,
                "--data-host", "{ip}", "--state-dir", state, "--address-file", "{dir}/address",
                *_security(self.token_file), *self.args]

    def start(self, timeout: float = 120.0, *, wait: bool = True) -> str:
        """Places and starts the agents; returns the coordinator's address once it listens. With
        `shm:` sources the agents wait for their training processes to register (Publisher) before
        the coordinator listens: start(wait=False) returns the address at once, then ready()."""
        self._stop.clear()
        self._place(lambda r: f"trainer-{r}", lambda r: [], keep_running=False)
        try:
            rank0 = self.nodes[0]["ip"]
            store_port, coordinator_port = ray.get(self.hosts[0].free_ports.remote(2))
            self.coordinator = f"{rank0}:{coordinator_port}"
            self._store = f"{rank0}:{store_port}"
            self._launch(timeout if wait else None)
        except BaseException:
            super().stop()  # nothing left running
            raise
        if self.watch:
            self._watcher = threading.Thread(target=self._supervise, name="wsync-trainer-agents", daemon=True)
            self._watcher.start()
        return self.coordinator

    def ready(self, timeout: float = 120.0) -> str:
        """Blocks until the coordinator listens (AgentStartError if an agent exited); its address."""
        self._check(timeout)
        return self.coordinator or ""

    def _launch(self, timeout: Optional[float]) -> None:
        coordinator = self.coordinator or ""
        ray.get([h.start.remote(self._argv(r, self._store, coordinator)) for r, h in enumerate(self.hosts)])
        self._incarnations = [i["incarnation"] for i in ray.get([h.info.remote() for h in self.hosts])]
        if timeout is not None:
            self._check(timeout)

    def _check(self, timeout: float) -> None:
        """Until rank 0's coordinator listens: AgentStartError naming the first rank that exited."""
        deadline = time.time() + timeout
        waiting = self.hosts[0].address.remote(timeout)
        while True:
            done, _ = ray.wait([waiting], timeout=0.5)
            for r, info in enumerate(ray.get([h.info.remote() for h in self.hosts], timeout=30)):
                if not info["running"]:
                    raise AgentStartError(info["ip"], f"trainer-{r}",
                                          f"exited with {info['returncode']}; its log ends:\n{info['tail']}")
            if done:
                try:
                    ray.get(waiting)
                except ray.exceptions.RayTaskError as e:
                    raise e.as_instanceof_cause()
                return
            if time.time() > deadline + 5:
                raise AgentStartError(self.nodes[0]["ip"], "trainer-0", f"the coordinator is not listening after "
                                      f"{timeout:.0f} s")

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._stop.wait(1.0):
            try:
                infos = ray.get([h.info.remote() for h in self.hosts], timeout=30)
            except Exception:  # noqa: BLE001 - a host actor being restarted by Ray: ask again
                continue
            gone = [r for r, i in enumerate(infos)
                    if not i["running"] or i["incarnation"] != self._incarnations[r]]
            if not gone or self._stop.is_set():
                continue
            print(f"wsync.ray: trainer agent(s) {gone} ended or were restarted by Ray: restarting the trainer "
                  f"agents", flush=True)
            try:
                ray.get([h.stop.remote() for h in self.hosts], timeout=60)
                if self._stop.is_set():
                    return
                self._launch(self.join_timeout)
                self.restarts += 1
                self.last_error, backoff = None, 1.0
            except Exception as e:  # noqa: BLE001 - kept in last_error; tried again, less and less often
                self.last_error = e
                print(f"wsync.ray: restarting the trainer agents failed (again in {backoff:.0f} s): {e}", flush=True)
                self._stop.wait(backoff)
                backoff = min(60.0, backoff * 2)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.join_timeout + timeout)
        super().stop(timeout)


def _rollout_host_name(group: str, index: int) -> str:
    return f"wsync-rollout-agent:{group}:{index}"


class RolloutAgents(_Group):
    """One wsync-rollout-agent per engine rank actor, joined to `coordinator`. The agent of
    actors[i] is found from anywhere in the cluster with rollout_agent_address(group, i)."""

    def __init__(self, actors: Sequence, coordinator: str, *, group: str = "rollout", bin_dir: Optional[str] = None,
                 args: Sequence[str] = (), token_file: Optional[str] = None, log_dir: Optional[str] = None) -> None:
        super().__init__(actors, "RolloutAgents", log_dir)
        self.coordinator, self.group = coordinator, group
        self.bin = _binary(bin_dir, "wsync-rollout-agent")
        self.args, self.token_file = list(args), token_file
        self.addresses: List[str] = []

    def start(self, timeout: float = 60.0) -> List[str]:
        """Places and starts the agents; returns their addresses (actors' order) once they listen."""
        argv = [self.bin, "--listen", "{ip}:{port}", "--coordinator", self.coordinator, "--address-file",
                "{dir}/address", *_security(self.token_file), *self.args]
        self._place(lambda i: f"rollout-{self.group}-{i}", lambda i: argv, keep_running=True,
                    lifetime_name=lambda i: _rollout_host_name(self.group, i))
        try:
            self.addresses = ray.get([h.address.remote(timeout) for h in self.hosts], timeout=timeout + 30)
        except BaseException as e:
            self.stop()  # nothing left running
            if isinstance(e, ray.exceptions.RayTaskError):
                raise e.as_instanceof_cause()
            raise
        return self.addresses


def rollout_agent_address(group: str, index: int, timeout: float = 120.0) -> str:
    """The address of engine rank actor `index`'s rollout agent (RolloutAgents(group=...)), once
    it listens: for the engine actor, at its start and after Ray restarted it."""
    deadline = time.time() + timeout
    while True:
        try:
            host = ray.get_actor(_rollout_host_name(group, index))
            left = max(1.0, deadline - time.time())
            return ray.get(host.address.remote(left), timeout=left + 10)
        except ValueError:  # not created yet
            if time.time() > deadline:
                raise
            time.sleep(0.2)
