"""The Kubernetes recipe of scripts/k8s/ (doc/kubernetes.md), tested without a cluster.

The manifests parse and name what the design needs: a privileged pod with /dev/fuse, the
backing directory and the mount's directory on hostPaths (the latter Bidirectional), the
host's network and PID namespaces (the upgrade socket is abstract, and the handover waits
for the old daemon's pid), a rolling update with maxSurge 1 and maxUnavailable 0, a
readiness probe, resource requests for the compiles, the cluster store from a Secret, and a
client pod that mounts the mount's directory with HostToContainer.

Then the pod's command, kcachefs-pod.sh (the very file the manifest runs, its paths set
through the environment), runs in mount namespaces that propagate as a node's do: a "host"
(unshare -m; a temporary directory, standing for /mnt/kcachefs, bind-mounted onto itself and
made rshared, as systemd makes /), daemon "pods" (unshare -m from it, propagation unchanged:
their view of the directory is a shared peer, which is what Bidirectional is) and a client
"pod" (unshare -m, then mount --make-rslave: HostToContainer). All of them share this
machine's network and PID namespaces, as hostNetwork and hostPID make the pods do. A pod is
deleted as the kubelet does: SIGTERM to its first process (the container runtime signals
only that one), SIGKILL to the rest once the grace period is over.

The client reads a cubin in a loop through a rolling update (a second pod takes the mount
over, the first is deleted): no read fails, and the mount is the same one (st_dev). The
pod deleted without a successor stops its daemon: the client's reads fail with the mount
gone, at once. A new pod mounts anew, and the client sees that mount (propagation); its
daemon is killed (a crash, or a grace period run out): the client gets ENOTCONN, never a
wait, and the next pod's start unmounts the dead mount and mounts again. The store is a
dir: store, read-only (remote_mode=ro, added to the manifest's options), so that the
Secret's URL and key reach the daemon while no share to the store runs in the background.
"""
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import EM_CUDA, KCACHEFS, REPO, entry_name, sample
from kcmount import slow_nvcc, wait_until

K8S = REPO / "scripts" / "k8s"
POD_SCRIPT = K8S / "kcachefs-pod.sh"
GiB = 1 << 30


def manifests(name):
    with open(K8S / name) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def the(name, kind):
    docs = manifests(name)
    assert [d["kind"] for d in docs] == [kind], "%s: one %s" % (name, kind)
    return docs[0]


def quantity(q):
    """A Kubernetes quantity ("8", "500m", "16Gi") as a number."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti)?", str(q))
    assert m, q
    scale = {None: 1, "m": 1e-3, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return float(m.group(1)) * scale[m.group(2)]


class PodSpec:
    """The DaemonSet's pod template, with lookups by volume and by path."""

    def __init__(self):
        self.ds = the("daemonset.yaml", "DaemonSet")
        self.spec = self.ds["spec"]["template"]["spec"]
        [self.c] = self.spec["containers"]
        self.env = {e["name"]: e for e in self.c["env"]}
        self.volumes = {v["name"]: v for v in self.spec["volumes"]}

    def value(self, name):
        return self.env[name]["value"]

    def volume_at(self, path):
        """(volumeMount, volume) of the container's mount that holds path."""
        holding = [m for m in self.c["volumeMounts"] if path == m["mountPath"] or
                   path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert holding, "no volume holds %s" % path
        m = max(holding, key=lambda m: len(m["mountPath"]))
        return m, self.volumes[m["name"]]


def test_the_daemonset_names_what_a_handover_between_pods_needs():
    p = PodSpec()
    strategy = p.ds["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    labels = p.ds["spec"]["template"]["metadata"]["labels"]
    assert p.ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The upgrade socket is abstract (in the network namespace), the handover waits for the
    # old daemon's pid: both pods on the host's.
    assert p.spec["hostNetwork"] is True and p.spec["hostPID"] is True
    assert p.spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert p.spec.get("restartPolicy", "Always") == "Always"
    assert p.c["securityContext"]["privileged"] is True
    assert p.spec["terminationGracePeriodSeconds"] >= 30

    m, v = p.volume_at("/dev/fuse")
    assert v["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    m, v = p.volume_at(p.value("KCACHEFS_BACKING"))
    assert v["hostPath"]["path"] == m["mountPath"] and m.get("mountPropagation") is None
    assert p.value("KCACHEFS_BACKING") != m["mountPath"], \
        "the store is a directory in the volume, whose root the pod makes root's only"
    mnt = p.value("KCACHEFS_MOUNTPOINT")
    m, v = p.volume_at(mnt)
    assert m["mountPropagation"] == "Bidirectional"
    assert v["hostPath"]["path"] == m["mountPath"] and mnt != m["mountPath"], \
        "the mount lies in the shared directory, which clients mount"
    m, v = p.volume_at("/run/kcachefs")  # KC_SANDBOX_RUN_DIR: compile uid claims, node-wide
    assert v["hostPath"]["path"] == "/run/kcachefs" and m["mountPath"] == "/run/kcachefs"
    m, v = p.volume_at(p.value("KCACHEFS_STATE"))
    assert "emptyDir" in v, "the pod's own state: the daemon's pid, the copies of secrets"
    options = p.value("KCACHEFS_OPTIONS").split(",")
    assert "holder" not in options and "allow_other" in options

    # The command and the readiness probe are kcachefs-pod.sh, from the ConfigMap that the
    # kustomization makes of this directory's file.
    kust = the("kustomization.yaml", "Kustomization")
    assert sorted(kust["resources"]) == ["daemonset.yaml", "namespace.yaml"]
    [gen] = kust["configMapGenerator"]
    assert gen["files"] == [POD_SCRIPT.name]
    [script_volume] = [n for n, v in p.volumes.items()
                       if v.get("configMap", {}).get("name") == gen["name"]]
    [script_dir] = [m["mountPath"] for m in p.c["volumeMounts"] if m["name"] == script_volume]
    script = "%s/%s" % (script_dir, POD_SCRIPT.name)
    assert p.c["command"] == ["/bin/sh", script, "run"]
    probe = p.c["readinessProbe"]
    assert probe["exec"]["command"] == ["/bin/sh", script, "ready"]
    # The script's own look at the mount times out first: a hung mount fails the probe.
    inner = int(re.search(r"^T=\$\{KCACHEFS_PROBE_TIMEOUT:-(\d+)\}$", POD_SCRIPT.read_text(),
                          re.M).group(1))
    assert inner < probe["timeoutSeconds"] and "KCACHEFS_PROBE_TIMEOUT" not in p.env
    assert '"$MNT/.kcachefs/stats"' in POD_SCRIPT.read_text()

    # Room for compiles: a core per job, and memory for two compilers a job slot (compile
    # ahead runs beside the clients' compiles) at 1 GiB each; no CPU limit to throttle them.
    jobs = int(re.search(r"\bjobs=(\d+)", p.value("KCACHEFS_OPTIONS")).group(1))
    resources = p.c["resources"]
    assert quantity(resources["requests"]["cpu"]) >= jobs
    assert quantity(resources["requests"]["memory"]) >= jobs * 2 * GiB
    assert "cpu" not in resources.get("limits", {})
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])

    # The cluster store's URL and key from the Secret of the example.
    secret = the("secret.example.yaml", "Secret")
    name = secret["metadata"]["name"]
    ref = p.env["KCACHEFS_REMOTE"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == name and ref["key"] == "remote_url"
    assert {"remote_url", "remote_key"} <= set(secret["stringData"])
    m, v = p.volume_at(p.value("KCACHEFS_SECRET"))
    assert v["secret"]["secretName"] == name and m["mountPath"] == p.value("KCACHEFS_SECRET")
    # Every name in one namespace, whose Pod Security level lets the pod run.
    ns = the("namespace.yaml", "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert (p.ds["metadata"]["namespace"] == secret["metadata"]["namespace"]
            == kust["namespace"] == ns["metadata"]["name"])


def test_the_client_pod_mounts_the_directory_of_the_mount_with_host_to_container():
    p = PodSpec()
    daemon_mount, daemon_volume = p.volume_at(p.value("KCACHEFS_MOUNTPOINT"))
    pod = the("client-pod.example.yaml", "Pod")["spec"]
    [v] = [v for v in pod["volumes"]
           if v.get("hostPath", {}).get("path") == daemon_volume["hostPath"]["path"]]
    containers = pod.get("initContainers", []) + pod["containers"]
    assert len(containers) == 2, "an init container waits for the mount, then the job"
    for c in containers:
        [m] = [m for m in c["volumeMounts"] if m["name"] == v["name"]]
        assert m["mountPropagation"] == "HostToContainer"
        assert m["mountPath"] == daemon_mount["mountPath"], "the same paths as on the node"
        assert not c.get("securityContext", {}).get("privileged")
    mnt = p.value("KCACHEFS_MOUNTPOINT")
    assert mnt + "/.kcachefs/stats" in " ".join(containers[0]["command"])
    cache_dirs = [e["value"] for e in containers[1]["env"] if e["name"].endswith(("_DIR", "_BASE"))]
    assert cache_dirs and all(d.startswith(mnt + "/") for d in cache_dirs)


# ---- the pods' command lines in mount namespaces ----

# Stages a kernel (its source and flags copied from two files) and opens its cubin (the
# mount compiles it), printing "opening" before the open and then "compiled <sha256>
# <e_machine>".
STAGE = r"""
import hashlib, os, struct, sys, time
entry, src, flags = sys.argv[1:4]
os.makedirs(entry)
for name, path in (("kernel.cu", src), ("kernel.flags", flags)):
    with open(os.path.join(entry, name), "wb") as f:
        f.write(open(path, "rb").read())
cubin = os.path.join(entry, "kernel.cubin")
print("opening", flush=True)
data = open(cubin, "rb").read()
print("compiled", hashlib.sha256(data).hexdigest(), struct.unpack_from("<H", data, 18)[0],
      flush=True)
"""

# The client: stages a kernel, then reads its cubin again and again until the file stop
# exists, one line a read: "ok <sha256> <st_dev> <seconds>" or "err <errno> <seconds>".
CLIENT = STAGE + r"""
stop = sys.argv[4]
while not os.path.exists(stop):
    t = time.monotonic()
    try:
        with open(cubin, "rb") as f:
            data = f.read()
            dev = os.fstat(f.fileno()).st_dev
        print("ok", hashlib.sha256(data).hexdigest(), dev, "%.3f" % (time.monotonic() - t),
              flush=True)
    except OSError as e:
        print("err", e.errno, "%.3f" % (time.monotonic() - t), flush=True)
    time.sleep(0.02)
"""


def waits_on_fuse(pid):
    """Whether pid sleeps in a FUSE request (the kernel's request_wait_answer)."""
    try:
        with open("/proc/%d/wchan" % pid) as f:
            return f.read() == "request_wait_answer"
    except OSError:
        return False


def mount_ns(pid):
    return os.readlink("/proc/%d/ns/mnt" % pid)


def exited(proc, timeout):
    """Whether proc (a Popen) exits within timeout seconds; it is not reaped, so that its
    pid stays its session's."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None and os.waitid(
            os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_session(proc):
    """SIGKILL the session proc leads (start_new_session), unless proc was reaped already:
    its number may then be another process's."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Node:
    """The "host": a mount namespace of its own whose directory shared (the hostPath
    /mnt/kcachefs) is a bind mount onto itself, made rshared. Pods and clients are made
    from it; nothing of it reaches this machine's own mount table."""

    def __init__(self, root):
        self.root = root
        self.shared = root / "mnt-kcachefs"
        self.mnt = self.shared / "kcache"
        self.backing = root / "var-cache-kcachefs" / "store"
        self.shared.mkdir(parents=True)
        self.proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c",
             'mount --bind "$0" "$0" && mount --make-rshared "$0" && echo ready && exec cat',
             str(self.shared)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True)
        assert self.proc.stdout.readline() == b"ready\n"
        self.ns = {mount_ns(self.proc.pid)}  # every mount namespace made here
        assert mount_ns(os.getpid()) not in self.ns
        self.procs = [self.proc]

    def start(self, argv, **popen):
        """argv in a new mount namespace made from the host's (propagation unchanged), in a
        session of its own; the namespace is remembered."""
        proc = subprocess.Popen(["nsenter", "-t", str(self.proc.pid), "-m", "--", "unshare", "-m",
                                 "--propagation", "unchanged", "--"] + argv,
                                start_new_session=True, **popen)
        self.procs.append(proc)
        # Until unshare has run, the child is in the host's namespace (nsenter) or in this
        # process's own (before nsenter): neither is one made here.
        outside = (mount_ns(os.getpid()), mount_ns(self.proc.pid))

        def unshared():
            try:
                return mount_ns(proc.pid) not in outside or None
            except OSError:
                return proc.poll() is not None  # gone already: said by the caller
        wait_until(unshared, "the new mount namespace was not made", 30, step=0.01)
        if proc.poll() is None:
            ns = mount_ns(proc.pid)
            if ns not in outside:
                self.ns.add(ns)
        return proc

    def mounts(self, pid):
        """The kcachefs mounts on mnt in pid's mount namespace."""
        with open("/proc/%d/mounts" % pid) as f:
            return [l for l in f if l.split()[1:3] == [str(self.mnt), "fuse.kcachefs"]]

    def leftovers(self):
        """Processes in one of the namespaces made here, or naming the node's directories.
        Never one in this process's own mount namespace that does not name them: that
        namespace is the machine's, shared with whatever else runs on it."""
        own = mount_ns(os.getpid())
        assert own not in self.ns
        pids = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                if int(d) == os.getpid():
                    continue
                ns = mount_ns(int(d))
                with open("/proc/%s/cmdline" % d, "rb") as f:
                    named = str(self.root).encode() in f.read()
                if named or (ns in self.ns and ns != own):
                    pids.append(int(d))
            except OSError:
                continue
        return pids

    def destroy(self):
        """Kill every process made here (by session, then any left in its namespaces): the
        namespaces, and the mounts in them, go with their last process."""
        for p in self.procs:
            kill_session(p)
        for _ in range(100):
            left = self.leftovers()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for p in self.procs:
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()


class Pod:
    """One container of the DaemonSet: kcachefs-pod.sh run, with its own state directory."""

    def __init__(self, node, name, env):
        self.node, self.name = node, name
        self.env = dict(env, KCACHEFS_STATE=str(node.root / ("state-" + name)))
        self.log_path = node.root / (name + ".log")
        with open(self.log_path, "ab") as log:
            self.proc = node.start(["/bin/sh", str(POD_SCRIPT), "run"], env=self.env,
                                   stdout=log, stderr=subprocess.STDOUT)

    def log(self):
        return self.log_path.read_text(errors="replace")

    def ready(self, timeout=None):
        """The readiness probe, run in the pod's mount namespace."""
        env = dict(self.env, **({"KCACHEFS_PROBE_TIMEOUT": str(timeout)} if timeout else {}))
        r = subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "--", "/bin/sh",
                            str(POD_SCRIPT), "ready"], env=env, capture_output=True,
                           timeout=120)
        return r.returncode == 0

    def daemon_pid(self):
        """The pid the pod's script wrote for its probe, or None (no daemon runs)."""
        try:
            return int((Path(self.env["KCACHEFS_STATE"]) / "daemon.pid").read_text())
        except (OSError, ValueError):
            return None

    def wait_ready(self):
        wait_until(lambda: self.ready() or self.proc.poll() is not None,
                   lambda: "pod %s not ready: %s" % (self.name, self.log()), 180, step=0.2)
        assert self.proc.poll() is None, self.log()

    def delete(self, grace):
        """As the kubelet deletes a pod: SIGTERM to the container's first process, then,
        past the grace period, SIGKILL to every process of it. Returns (exit status, whether
        the grace period ran out)."""
        self.proc.send_signal(signal.SIGTERM)
        killed = not exited(self.proc, grace)
        kill_session(self.proc)
        return self.proc.wait(timeout=30), killed


class Reads:
    """The client's lines, as they come, split into words."""

    def __init__(self, proc):
        self.lines = []
        self.proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.split())

    def since(self, mark, kind=None):
        return [w for w in self.lines[mark:] if kind is None or w[0] == kind]

    def wait(self, mark, kind, n=1, timeout=120):
        return wait_until(lambda: len(self.since(mark, kind)) >= n and self.since(mark, kind),
                          lambda: "no %d %r reads after line %d: %s" % (
                              n, kind, mark, self.lines[-5:]), timeout, step=0.02)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path / "node")
    yield n
    n.destroy()
    assert not n.leftovers(), "processes left in the node's namespaces"
    with open("/proc/self/mounts") as f:
        assert str(tmp_path) not in f.read(), "a mount reached this machine's mount table"


def pod_env(node, tmp_path, nvcc):
    """The manifest's environment, with this node's paths, the built daemon, a compiler of
    the test's (nvcc), and a dir: store and a Secret's volume of the test's."""
    p = PodSpec()
    env = {k: e["value"] for k, e in p.env.items() if "value" in e}
    store = tmp_path / "store"
    store.mkdir()
    # A Secret's volume: each key a symbolic link into a ..data directory, mode 0644.
    secret = tmp_path / "secret"
    (secret / "..data").mkdir(parents=True)
    (secret / "..data" / "remote_key").write_bytes(os.urandom(24).hex().encode())
    os.chmod(secret / "..data" / "remote_key", 0o644)
    os.symlink("..data/remote_key", secret / "remote_key")
    env.update(KCACHEFS=str(KCACHEFS), KCACHEFS_BACKING=str(node.backing),
               KCACHEFS_MOUNTPOINT=str(node.mnt), KCACHEFS_SECRET=str(secret),
               KCACHEFS_REMOTE="dir:%s" % store,
               KCACHEFS_OPTIONS=env["KCACHEFS_OPTIONS"] + ",remote_mode=ro,nvcc=%s" % nvcc)
    return dict(os.environ, **env)


def test_pods_hand_the_mount_over_and_a_deletion_without_successor_ends_it(node, tmp_path):
    # Compiles with -DK8S_HANDOVER wait until the file release exists.
    release = tmp_path / "release"
    env = pod_env(node, tmp_path, slow_nvcc(tmp_path, release, "*-DK8S_HANDOVER*"))
    grace = PodSpec().spec["terminationGracePeriodSeconds"]

    # The first pod mounts; the client pod starts once it is ready.
    a = Pod(node, "a", env)
    a.wait_ready()
    log = a.log()
    assert "kcachefs-pod: mounting" in log and "objects signed" in log, log
    assert "(read-only)" in log, log
    src, flags = sample("vector_add")
    entry = node.mnt / "k8s" / entry_name("vector_add", src, flags)
    stop = tmp_path / "stop-client"
    # The client pod: its view of the directory is a slave of the host's (HostToContainer).
    client = node.start(["sh", "-c", 'mount --make-rslave "$0" && exec "$@"',
                         str(node.shared), sys.executable, "-c", CLIENT, str(entry),
                         str(sample_file(tmp_path, "vector_add.cu", src)),
                         str(sample_file(tmp_path, "vector_add.flags", flags)), str(stop)],
                        stdout=subprocess.PIPE, text=True)
    reads = Reads(client)
    compiled = reads.wait(0, "compiled", timeout=300)[0]
    assert reads.since(0)[0] == ["opening"]
    assert int(compiled[2]) == EM_CUDA, compiled
    sha = compiled[1]
    first = reads.wait(0, "ok", 5)
    dev = first[0][2]

    # A rolling update: the new pod takes the mount over while the old one runs. The old
    # daemon has a compile in hand, held until release exists: it answers that open before
    # it hands over, reading no new request meanwhile, so the client's next read waits in
    # the kernel's queue until the new daemon serves.
    hsrc, hflags = src + b"\n// compiled during the handover\n", flags + b"-DK8S_HANDOVER\n"
    held = subprocess.Popen(["nsenter", "-t", str(client.pid), "-m", "--", sys.executable, "-c",
                             STAGE, str(node.mnt / "k8s" / entry_name("vector_add", hsrc, hflags)),
                             str(sample_file(tmp_path, "held.cu", hsrc)),
                             str(sample_file(tmp_path, "held.flags", hflags))],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    node.procs.append(held)
    assert held.stdout.readline() == "opening\n"
    wait_until(lambda: waits_on_fuse(held.pid), "the open did not wait for its compile", 60)
    before = len(reads.lines)
    b = Pod(node, "b", env)
    wait_until(lambda: "upgrade: handing the mount to pid" in a.log(),
               lambda: "no handover: %s%s" % (a.log(), b.log()), 120)
    last = [-1]

    def client_queued():  # waits in a request, and no read ended since the last look
        n, last[0] = last[0], len(reads.lines)
        return waits_on_fuse(client.pid) and n == last[0]
    wait_until(client_queued, "the client's read did not wait", 60, step=0.2)
    queued = len(reads.lines)
    release.write_text("")
    assert held.stdout.readline().split()[2] == str(EM_CUDA) and held.wait(timeout=60) == 0
    b.wait_ready()
    through_handover = reads.wait(queued, "ok")[0]
    assert through_handover[1] == sha, "the read queued during the handover"
    in_hand = int(re.search(r"the mount is pid \d+'s now \((\d+) requests answered",
                            a.log()).group(1))
    assert in_hand >= 1, a.log()
    wait_until(lambda: "handed the mount to another daemon" in a.log(),
               lambda: "pod a: " + a.log(), 60)
    assert "a live kcachefs mount is on" in b.log() and "taken over from the running daemon" \
        in b.log(), b.log()
    # The old pod serves nothing and is not ready, and it runs on: were it to exit, the
    # kubelet would start it again, and that start would take the mount back.
    assert not a.ready() and a.daemon_pid() is None
    handed = len(reads.lines)
    reads.wait(handed, "ok", 3)
    assert a.proc.poll() is None, a.log()
    rc, killed = a.delete(grace)
    assert (rc, killed) == (0, False), a.log()
    deleted = len(reads.lines)
    reads.wait(deleted, "ok", 5)
    assert b.ready() and node.mounts(client.pid)
    through = reads.since(before)
    assert not [w for w in through if w[0] != "ok"], through
    assert {(w[1], w[2]) for w in through} == {(sha, dev)}, "the same bytes, the same mount"
    print("\nrolling update: the client read the cubin %d times before the new pod started and "
          "%d until the old daemon stopped reading requests; its next read waited %s s in the "
          "kernel's queue through the handover (the old daemon answered its %d in hand, a "
          "compile's open among them, first); %d reads until the old pod's deletion, %d after "
          "it; none failed, every read the same bytes from the same mount"
          % (before - 2, queued - before, through_handover[3], in_hand, deleted - queued - 1,
             len(reads.lines) - deleted))

    # The only pod is deleted, no successor: its daemon stops and unmounts; the client's
    # reads fail at once (the mount is gone), they do not wait.
    mark = len(reads.lines)
    t = time.monotonic()
    rc, killed = b.delete(grace)
    assert (rc, killed) == (0, False), b.log()
    gone = reads.wait(mark, "err")[0]
    seen = time.monotonic() - t
    assert int(gone[1]) in (errno.ENOENT, errno.ENOTCONN), gone
    assert not node.mounts(client.pid) and not node.mounts(node.proc.pid)
    assert "kcachefs-pod: stopped: the daemon exited with status 0" in b.log(), b.log()
    print("deleted without a successor: the client's read failed with %s %.2f s after the "
          "SIGTERM (that read took %s s)" % (errno.errorcode[int(gone[1])], seen, gone[2]))

    # A new pod mounts anew, and the client sees the new mount (HostToContainer).
    c = Pod(node, "c", env)
    c.wait_ready()
    mark = len(reads.lines)
    assert reads.wait(mark, "ok")[0][1] == sha
    # A hung daemon fails the probe, within its timeout, rather than hanging it.
    daemon = c.daemon_pid()
    os.kill(daemon, signal.SIGSTOP)
    t = time.monotonic()
    assert not c.ready(timeout=2)
    hung = time.monotonic() - t
    # Its daemon is killed (a crash, or a deletion whose grace period ran out): the mount
    # is dead, and the client gets ENOTCONN (the read in hand ECONNABORTED), never a wait.
    mark = len(reads.lines)
    os.kill(daemon, signal.SIGKILL)
    assert c.proc.wait(timeout=60) == 128 + signal.SIGKILL, c.log()
    assert "left a dead mount" in c.log(), c.log()
    reads.wait(mark, "err")
    wait_until(lambda: [w for w in reads.since(mark, "err") if int(w[1]) == errno.ENOTCONN],
               lambda: reads.since(mark), 60)
    assert {int(w[1]) for w in reads.since(mark, "err")} <= {errno.ENOTCONN, errno.ECONNABORTED}
    assert node.mounts(client.pid), "the dead mount stays until a start unmounts it"
    print("a hung daemon failed the probe in %.2f s; killed, the client's reads failed with %s"
          % (hung, sorted({errno.errorcode[int(w[1])] for w in reads.since(mark, "err")})))

    # The kubelet starts the container again: the dead mount is unmounted, a new one made,
    # and the client reads through it.
    d = Pod(node, "d", env)
    d.wait_ready()
    assert "is dead: mounting anew" in d.log() and "has a dead kcachefs mount" in d.log(), d.log()
    mark = len(reads.lines)
    assert reads.wait(mark, "ok")[0][1] == sha
    assert len(node.mounts(client.pid)) == 1
    rc, killed = d.delete(grace)
    assert (rc, killed) == (0, False), d.log()
    stop.write_text("")
    assert client.wait(timeout=60) == 0
    assert not node.mounts(node.proc.pid)


def sample_file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return path
