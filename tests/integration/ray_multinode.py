"""The driver of ray_multinode.sh (read its header): run inside node 1's namespace, on the Ray
cluster that script started. Places two trainer actors on node 1 and two engine actors on nodes 2
and 3, starts wsync's agents beside them with wsync.ray, and checks every sync with wsyncctl.

    ray_multinode.py WORK BIN TOKEN KILL_CMD RESTART_CMD

KILL_CMD slows node 3's link, waits 2 s and kills every process of node 3; RESTART_CMD restores
the link and starts node 3's raylet again.

Prints one line per check; exits non-zero naming the first that failed.
"""

import json
import pathlib
import subprocess
import sys
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from wsync.ray import AgentStartError, RolloutAgents, TrainerAgents, rollout_agent_address

work, bindir, token, kill_cmd, restart_cmd = sys.argv[1:6]
work = pathlib.Path(work)


def fail(msg):
    print(f"ray_multinode: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


@ray.remote(num_cpus=0, resources={"wsync_trainer": 1})
class Trainer:
    """A stand-in for a Megatron rank: wsync.ray asks it only where it runs."""

    def rank_node(self):
        return ray.util.get_node_ip_address()


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Engine:
    """One engine (TP 1): a wsync-ref-engine process beside this actor's rollout agent, found by
    the agent's group and index; started again by itself when Ray restarts the actor."""

    def __init__(self, index, bindir, config, token):
        self.index, self.bindir, self.config, self.token = index, bindir, config, token
        self.proc, self.address = None, None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self.serve()

    def serve(self):
        import ctypes
        import signal
        agent = rollout_agent_address("engines", self.index)
        ip = ray.util.get_node_ip_address()
        out = pathlib.Path(f"/tmp/ray-mn-engine-{self.index}-{time.time_ns()}")
        self.proc = subprocess.Popen(
            [f"{self.bindir}/wsync-ref-engine", "--model", self.config, "--engine-id", f"engine-{self.index}",
             "--listen", f"{ip}:0", "--address-file", str(out), "--agent", agent, "--token-file", self.token],
            stdout=open(f"{out}.log", "w"), stderr=subprocess.STDOUT,
            preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL))
        for _ in range(600):
            if out.exists() and out.read_text().strip():
                self.address = out.read_text().strip()
                return self.address, agent
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.index} exited: {pathlib.Path(f'{out}.log').read_text()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"engine {self.index} did not listen")


ray.init(address="auto", log_to_driver=False)
ctl = [f"{bindir}/wsyncctl", "--token-file", token]

# --- placement: trainers packed on node 1 (a placement group), engines spread over nodes 2 and 3 ---
tpg = placement_group([{"wsync_trainer": 1}] * 2, strategy="STRICT_PACK")
epg = placement_group([{"wsync_engine": 1}] * 2, strategy="STRICT_SPREAD")
ray.get([tpg.ready(), epg.ready()], timeout=60)
trainers = [Trainer.options(scheduling_strategy=PlacementGroupSchedulingStrategy(tpg, placement_group_bundle_index=r)).remote()
            for r in range(2)]
engines = [Engine.options(resources={"wsync_engine": 1},
                          scheduling_strategy=PlacementGroupSchedulingStrategy(epg, placement_group_bundle_index=i)).remote(
    i, bindir, str(work / "hf1" / "config.json"), token) for i in range(2)]

# A failure to start names the node and the reason: a trainer agent without its source.
bad = TrainerAgents(trainers, source=f"dir:{work}/no-such-dir", bin_dir=bindir, token_file=token,
                    log_dir=str(work / "bad"), watch=False)
try:
    bad.start(timeout=30)
    fail("trainer agents on a missing source started")
except AgentStartError as e:
    if e.node != "10.212.0.1" or "no-such-dir" not in e.reason:
        fail(f"the start failure does not name node 10.212.0.1 and the missing source: {e}")
    print(f"ray_multinode: a bad start is refused, naming the node: {e.agent} on node {e.node}: "
          f"{e.reason.splitlines()[-1]}", flush=True)
finally:
    bad.stop()

trainer = TrainerAgents(trainers, source=f"dir:{work}/megatron", bin_dir=bindir, token_file=token,
                        log_dir=str(work / "trainer"), args=["--sync-timeout", "20", "--bucket-mib", "4"])
coordinator = trainer.start()
if not coordinator.startswith("10.212.0.1:"):
    fail(f"the coordinator is at {coordinator}, not on node 1 (10.212.0.1)")
rollout = RolloutAgents(engines, coordinator, group="engines", bin_dir=bindir, token_file=token,
                        log_dir=str(work / "rollout"), args=["--heartbeat-ms", "500"])
agents = rollout.start()
if sorted(a.rsplit(":", 1)[0] for a in agents) != ["10.212.0.2", "10.212.0.3"]:
    fail(f"the rollout agents listen on {agents}, not one on each of nodes 2 and 3")
served = ray.get([e.serve.remote() for e in engines])
print(f"ray_multinode: coordinator {coordinator}; rollout agents {agents}; engines {[s[0] for s in served]}", flush=True)
ctl += ["--coordinator", coordinator]


def run(*args, check=True):
    r = subprocess.run(ctl + list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        fail(f"wsyncctl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def members():
    r = run("--json", "status", check=False)
    return json.loads(r.stdout)["members"] if r.returncode == 0 else 0


def wait_members(n, seconds):
    end = time.time() + seconds
    while members() < n:
        if time.time() > end:
            fail(f"only {members()} of {n} rollout agents joined within {seconds} s")
        time.sleep(0.5)


def verify(hf, seconds=0):
    end = time.time() + seconds
    while True:
        r = run("verify", "--against", str(hf), check=False)
        if r.returncode == 0 and r.stdout.count("bit-exact") == 2:
            ind = run("verify", "--independent", "--against", str(hf), check=False)
            if ind.returncode == 0 and ind.stdout.count("equal to the reference") == 2:
                return
            r = ind
        if time.time() > end:
            fail(f"verify against {hf}: not both engines bit-exact:\n{r.stdout}{r.stderr}")
        time.sleep(1)


wait_members(2, 60)
# 1. Broadcast, then sharded: every byte crosses a veth link (the trainers are on node 1 only).
run("sync", "--wait", "--min-agents", "2")
verify(work / "hf1")
print("ray_multinode: sync 1 (broadcast) from node 1 to nodes 2 and 3: bit-exact on both engines", flush=True)
subprocess.run(["bash", "-c", f"rm -rf {work}/megatron && cp -r {work}/megatron2 {work}/megatron"], check=True)
out = run("sync", "--wait", "--min-agents", "2", "--delivery", "sharded").stdout
verify(work / "hf2")
print("ray_multinode: sync 2 (sharded) bit-exact on both engines", flush=True)

# 2. Node 3 killed (-9, every process of it) in the middle of a sync: no engine serves a mixed
# version; Ray brings the actors back on the restarted node; the next sync succeeds.
subprocess.run(["bash", "-c", f"rm -rf {work}/megatron && cp -r {work}/megatron1 {work}/megatron"], check=True)
sync = subprocess.Popen(ctl + ["sync", "--wait", "--min-agents", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)
subprocess.run(["bash", "-c", kill_cmd], check=True)  # slows node 3's link, waits 2 s, kills node 3
if sync.poll() is not None:
    fail(f"the sync ended before node 3 was killed (the slowed link should hold it): {sync.stdout.read()}")
said = sync.communicate(timeout=120)[0]
print(f"ray_multinode: node 3 killed mid-sync; the sync said: {said.strip().splitlines()[-1]}", flush=True)
r = run("verify", "--against", str(work / "hf2"), check=False)
r1 = run("verify", "--against", str(work / "hf1"), check=False)
alive = next(i for i, (address, _) in enumerate(served) if address.startswith("10.212.0.2:"))  # node 2's engine
e0 = [ln for ln in (r.stdout + r1.stdout).splitlines() if f"engine-{alive} " in ln and "bit-exact" in ln]
if len(e0) != 1:
    fail(f"engine {alive} (node 2) is not bit-exact on exactly one whole version after the kill:\n{r.stdout}{r1.stdout}")
print(f"ray_multinode: node 2's engine serves one whole version: {e0[0].strip()}", flush=True)
subprocess.run(["bash", "-c", restart_cmd], check=True)
t0 = time.time()
while True:  # Ray notices the dead node, restarts the actors on the new one; their agent rejoins
    r = run("sync", "--wait", "--min-agents", "2", check=False)
    if r.returncode == 0:
        break
    if time.time() - t0 > 180:
        fail(f"no sync succeeded within 180 s of node 3's restart: {r.stdout}{r.stderr}")
    time.sleep(2)
print(f"ray_multinode: a sync succeeded {time.time() - t0:.0f} s after node 3 was started again", flush=True)
verify(work / "hf1", seconds=30)
print("ray_multinode: Ray restarted node 3's actors; their agent rejoined; the next sync is bit-exact on both engines",
      flush=True)

# 3. The trainer side: a trainer agent that dies is restarted with the whole trainer job (rank 0's
# durable state), and the sync after it is bit-exact.
subprocess.run(["kill", "-9", str(ray.get(trainer.hosts[1].info.remote())["pid"])], check=True)
end = time.time() + 60
while trainer.restarts < 1 and time.time() < end:
    time.sleep(0.5)
if trainer.restarts < 1:
    fail("the trainer agents were not restarted after rank 1 was killed")
wait_members(2, 60)
subprocess.run(["bash", "-c", f"rm -rf {work}/megatron && cp -r {work}/megatron2 {work}/megatron"], check=True)
end = time.time() + 60
while run("sync", "--wait", "--min-agents", "2", check=False).returncode != 0:
    if time.time() > end:
        fail("no sync succeeded after the trainer agents restarted")
    time.sleep(1)
verify(work / "hf2")
print("ray_multinode: trainer rank 1 killed: the trainer agents restarted as one job; the next sync is bit-exact",
      flush=True)
# 4. The agents end with their group: the rollout agents by stop(); the trainer agents with this
# driver's job (their host actors end with it, and each agent dies with its host): ray_multinode.sh
# checks that none is left once this exits.
rollout.stop()
left = subprocess.run(["pgrep", "-f", f"wsync-rollout-agent .*{work}/rollout"], capture_output=True, text=True).stdout
if left.strip():
    fail(f"rollout agents left after RolloutAgents.stop(): pids {left.split()}")
pids = [str(i["pid"]) for i in ray.get([h.info.remote() for h in trainer.hosts])]
print(f"ray_multinode: trainer agent pids {' '.join(pids)}", flush=True)
print("ray_multinode: passed", flush=True)
