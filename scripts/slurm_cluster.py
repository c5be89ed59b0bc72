"""A real SLURM cluster on one Linux machine: a controller and N compute nodes, each a network + UTS + mount
namespace with its own host name, loopback and a veth link to the controller's bridge (the tests'
multi-host cluster, tests/test_slurm.py; docs/scaling.md shows the recipe it runs).

  python scripts/slurm_cluster.py up DIR [--nodes 2]   # installs slurm-wlm + munge when missing (apt, root)
  python scripts/slurm_cluster.py run DIR HOST -- CMD...  # CMD inside HOST's namespaces (ctl: the login node)
  python scripts/slurm_cluster.py kill DIR HOST          # SIGKILL every process of HOST (a lost node)
  python scripts/slurm_cluster.py boot DIR HOST          # HOST's slurmd again (the node back from a crash)
  python scripts/slurm_cluster.py status DIR             # what is left: processes, namespaces
  python scripts/slurm_cluster.py down DIR               # every process in the namespaces ends; nothing remains

Nothing routes outside: addresses only on the namespaces' own links (10.52.0.0/24), no default route, none
in the machine's own namespace. Each namespace is held by one `sleep` process; its mounts (an empty tmpfs on
/sys/fs/cgroup, which slurmd 22.05's cgroup/v1 plugin wants present, and DIR/hosts over /etc/hosts) live in
its private mount namespace and go with it. munged runs in the controller's namespace; its socket is a file
in DIR, which every namespace sees. Where the machine forbids namespaces, `up` prints one line starting
"skip:" and exits with SKIP (77).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

SKIP = 77
SUBNET = "10.52.0"
CONTROLLER = "ctl"
PACKAGES = ("slurm-wlm", "munge")
STATE = "cluster.json"

SLURM_CONF = """\
ClusterName=opdjax
SlurmctldHost={ctl}({subnet}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = "NodeName={name} NodeAddr={addr} CPUs=32 Sockets=1 CoresPerSocket=32 ThreadsPerCore=1 State=UNKNOWN"


def log(msg: str) -> None:
  print(f"slurm_cluster.py: {msg}", file=sys.stderr, flush=True)


def sh(*cmd, check=True, **kw) -> subprocess.CompletedProcess:
  p = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
  if check and p.returncode:
    raise SystemExit(f"slurm_cluster.py: `{' '.join(cmd)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
  return p


def hosts(n: int) -> dict[str, str]:
  """Host name -> address: the controller first, then n1..nN."""
  return {CONTROLLER: f"{SUBNET}.1", **{f"n{i}": f"{SUBNET}.{i + 1}" for i in range(1, n + 1)}}


def forbidden() -> str | None:
  """Why this machine cannot make the namespaces (None: it can)."""
  if os.geteuid() != 0:
    return "needs root (namespaces, veth links, the SLURM daemons)"
  for tool in ("unshare", "nsenter", "ip"):
    if shutil.which(tool) is None:
      return f"no `{tool}` on PATH (util-linux, iproute2)"
  p = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
  if p.returncode:
    return f"the machine forbids network/UTS/mount namespaces ({p.stderr.strip() or p.returncode})"
  return None


def install() -> None:
  """slurm-wlm and munge from the distribution, once (about 17 s on Debian 12)."""
  if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
    return
  if shutil.which("apt-get") is None:
    raise SystemExit("slurm_cluster.py: slurm-wlm and munge are missing and there is no apt-get: install them"
                     " (SLURM 22.05 or later) and rerun.")
  log("installing slurm-wlm and munge (apt-get)")
  env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
  sh("apt-get", "update", "-qq", env=env)
  sh("apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES, env=env)


def load(d: str) -> dict:
  with open(os.path.join(d, STATE)) as f:
    return json.load(f)


def enter(state: dict, host: str) -> list[str]:
  """The command prefix that runs in `host`'s namespaces."""
  if host not in state["holders"]:
    raise SystemExit(f"slurm_cluster.py: no host {host!r} in this cluster: give one of {', '.join(state['holders'])}.")
  return ["nsenter", "-t", str(state["holders"][host]), "--net", "--uts", "--mount", f"--wd={os.getcwd()}", "--"]


def env_for(d: str) -> dict:
  return {**os.environ, "SLURM_CONF": os.path.join(d, "slurm.conf")}


def spawn(state: dict, host: str, cmd: list[str], logname: str) -> None:
  """A daemon in `host`'s namespaces, detached from this process (it lives until `down` or `kill`)."""
  with open(os.path.join(state["dir"], logname), "ab") as out:
    subprocess.Popen([*enter(state, host), *cmd], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                     env=env_for(state["dir"]), start_new_session=True)


def _ns(pid: int | str) -> int | None:
  try:
    return os.stat(f"/proc/{pid}/ns/net").st_ino
  except OSError:
    return None


def members(holder: int) -> list[int]:
  """Every process in `holder`'s network namespace, the holder excluded."""
  want = _ns(holder)
  if want is None:
    return []
  return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != holder and _ns(p) == want]


def kill_all(holder: int, timeout_s: float = 10.0) -> list[int]:
  """SIGKILL every process of the namespace until none is left; returns those that refused to go."""
  deadline = time.time() + timeout_s
  while (pids := members(holder)) and time.time() < deadline:
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    time.sleep(0.05)
  return members(holder)


def wait_for(what: str, test, timeout_s: float, state: dict) -> None:
  deadline = time.time() + timeout_s
  while not test():
    if time.time() > deadline:
      tail = ""
      for name in ("slurmctld.log", "daemons.log"):
        path = os.path.join(state["dir"], name)
        if os.path.exists(path):
          tail += f"\n--- {name}:\n" + open(path).read()[-1500:]
      raise SystemExit(f"slurm_cluster.py: {what} did not happen within {timeout_s:.0f} s.{tail}")
    time.sleep(0.1)


def sinfo(state: dict) -> dict[str, str]:
  p = sh(*enter(state, CONTROLLER), "sinfo", "-h", "-N", "-o", "%N %t", check=False, env=env_for(state["dir"]))
  return dict(line.split() for line in p.stdout.splitlines() if len(line.split()) == 2) if p.returncode == 0 else {}


def up(d: str, n: int) -> dict:
  why = forbidden()
  if why:
    print(f"skip: no SLURM cluster on this machine: {why}.", flush=True)
    raise SystemExit(SKIP)
  install()
  d = os.path.abspath(d)
  os.makedirs(d, exist_ok=True)
  if os.path.exists(os.path.join(d, STATE)):
    down(d)
  names = hosts(n)
  with open(os.path.join(d, "hosts"), "w") as f:
    f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in names.items()))
  nodes = [h for h in names if h != CONTROLLER]
  with open(os.path.join(d, "slurm.conf"), "w") as f:
    f.write(SLURM_CONF.format(ctl=CONTROLLER, subnet=SUBNET, dir=d, names=",".join(nodes),
                              nodes="\n".join(NODE_LINE.format(name=h, addr=names[h]) for h in nodes)))
  with open(os.path.join(d, "cgroup.conf"), "w") as f:
    f.write("CgroupPlugin=cgroup/v1\n")
  for sub in ("state", "spool"):
    os.makedirs(os.path.join(d, sub), exist_ok=True)
  key = os.path.join(d, "munge.key")
  if not os.path.exists(key):
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
  os.chmod(key, 0o600)
  state = {"dir": d, "holders": {}, "nodes": nodes, "addresses": names}
  for h in names:  # one `sleep` holds each host's namespaces
    state["holders"][h] = subprocess.Popen(
      ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sleep", "infinity"],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True).pid
  with open(os.path.join(d, STATE), "w") as f:
    json.dump(state, f)
  wait_for("the namespaces", lambda: all(_ns(p) != _ns("self") for p in state["holders"].values()), 10, state)
  ctl = enter(state, CONTROLLER)
  sh(*ctl, "ip", "link", "add", "br0", "type", "bridge")
  sh(*ctl, "ip", "addr", "add", f"{names[CONTROLLER]}/24", "dev", "br0")
  for h, holder in state["holders"].items():
    inside = enter(state, h)
    sh(*inside, "hostname", h)
    sh(*inside, "ip", "link", "set", "lo", "up")
    sh(*inside, "mount", "-t", "tmpfs", "none", "/sys/fs/cgroup")
    sh(*inside, "mount", "--bind", os.path.join(d, "hosts"), "/etc/hosts")
    if h == CONTROLLER:
      continue
    sh(*ctl, "ip", "link", "add", f"v-{h}", "type", "veth", "peer", "name", "eth0", "netns", str(holder))
    sh(*ctl, "ip", "link", "set", f"v-{h}", "master", "br0", "up")
    sh(*inside, "ip", "addr", "add", f"{names[h]}/24", "dev", "eth0")
    sh(*inside, "ip", "link", "set", "eth0", "up")
  sh(*ctl, "ip", "link", "set", "br0", "up")
  socket_path = os.path.join(d, "munge.socket")
  spawn(state, CONTROLLER, ["munged", "-F", "-f", f"--socket={socket_path}", f"--key-file={key}",
                            f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                            f"--seed-file={d}/munged.seed"], "daemons.log")
  wait_for("munged's socket", lambda: os.path.exists(socket_path), 20, state)
  conf = os.path.join(d, "slurm.conf")
  spawn(state, CONTROLLER, ["slurmctld", "-D", "-i", "-f", conf], "daemons.log")
  for h in nodes:
    boot(state, h, wait=False)
  wait_for("every node idle", lambda: set(sinfo(state).items()) >= {(h, "idle") for h in nodes}, 60, state)
  return state


def boot(state: dict, host: str, wait: bool = True) -> None:
  """`host`'s slurmd (again: a node back from a crash registers and returns to service)."""
  spawn(state, host, ["slurmd", "-D", "-f", os.path.join(state["dir"], "slurm.conf")], "daemons.log")
  if wait:
    wait_for(f"{host} idle", lambda: sinfo(state).get(host) == "idle", 60, state)


def leftovers(state: dict) -> list[str]:
  """What of the cluster still exists: processes in its namespaces, the holders themselves."""
  out = []
  for h, holder in state["holders"].items():
    if _ns(holder) is not None:
      out.append(f"{h}: namespace holder {holder}")
      out += [f"{h}: pid {p} {_cmdline(p)}" for p in members(holder)]
  return out


def _cmdline(pid: int, limit: int | None = 120) -> str:
  """`pid`'s command line, cut at `limit` characters for a status line (None: whole, for a test to read)."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
  except OSError:
    return "?"


def down(d: str) -> None:
  """Every process of every namespace ends (job steps outlive slurmd, servers outlive jobs), then the holders:
  the namespaces, their links and their mounts go with the last process."""
  state = load(d)
  stuck = []
  for h, holder in state["holders"].items():
    stuck += [f"{h}: pid {p}" for p in kill_all(holder)]
    if _ns(holder) is not None:
      os.kill(holder, signal.SIGKILL)
  deadline = time.time() + 10
  while (left := leftovers(state)) and time.time() < deadline:
    time.sleep(0.05)
  os.remove(os.path.join(d, STATE))
  if stuck or left:
    raise SystemExit(f"slurm_cluster.py: could not end {', '.join(stuck + left)}.")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("action", choices=("up", "down", "status", "run", "kill", "boot"))
  ap.add_argument("dir")
  ap.add_argument("host", nargs="?")
  ap.add_argument("--nodes", type=int, default=2)
  ap.add_argument("cmd", nargs=argparse.REMAINDER)
  a = ap.parse_args(argv)
  if a.action == "up":
    t0 = time.time()
    state = up(a.dir, a.nodes)
    log(f"up in {time.time() - t0:.1f} s: controller {CONTROLLER}, nodes {', '.join(state['nodes'])}"
        f" (SLURM_CONF={os.path.join(state['dir'], 'slurm.conf')})")
    return 0
  if a.action == "down":
    down(a.dir)
    return 0
  if not os.path.exists(os.path.join(a.dir, STATE)):
    print(f"no cluster in {a.dir} (none is up, or `down` ended it)")
    return 0 if a.action == "status" else 2
  state = load(a.dir)
  if a.action == "status":
    left = leftovers(state)
    print("\n".join(left) or "nothing left")
    print(json.dumps(sinfo(state)))
    return 0
  if not a.host:
    ap.error(f"{a.action} needs a HOST ({', '.join(state['holders'])})")
  if a.action == "kill":
    left = kill_all(state["holders"][a.host], timeout_s=5)
    return 1 if left else 0
  if a.action == "boot":
    boot(state, a.host)
    return 0
  cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
  return subprocess.run([*enter(state, a.host), *cmd], env=env_for(state["dir"])).returncode


if __name__ == "__main__":
  sys.exit(main())
