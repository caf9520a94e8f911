"""A directory exported over sshfs between two network namespaces of its own.

The server namespace (kc-srv-<pid>) runs Debian's sshd on 10.231.0.1 only, with a host key
and a root key pair made for this export; the client namespace (kc-cli-<pid>) holds the
other end of a veth pair (10.231.0.2). Both ends are created inside their namespaces, so
no address or link ever exists outside them. sshfs itself runs in this mount namespace
(its FUSE mount is visible to every daemon here) and reaches the server through
`ip netns exec kc-cli-<pid> ssh` (ssh_command): only ssh lives in the client namespace.
Attribute and entry caching are on (cache=yes, attr_timeout, entry_timeout), which is the
point: stale attributes and cached negative lookups, as on a real network filesystem.
reconnect is on, as on real nodes: without it sshfs exits when the connection drops and its
mount goes with it, leaving the bare mountpoint directory as a silent local "store".

stop() undoes everything it did, whatever state start() reached: the mount unmounted
(lazily if busy), sshfs and every process in the server namespace killed by pid, both
namespaces deleted (which deletes the veth pair). /run/sshd (sshd's privilege separation
directory, which Debian's tmpfiles.d makes at boot) is created if missing and left: it is
empty, root's, and another sshd may be using it.
"""
import os
import shutil
import signal
import subprocess
from pathlib import Path

from kcmount import wait_until

SERVER_ADDR = "10.231.0.1"
CLIENT_ADDR = "10.231.0.2"
SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
READY_WAIT = 60  # seconds for sshd to listen and sshfs to mount on a busy machine


def missing_prerequisite():
    """Why an export cannot be made here (a sentence), or None."""
    if os.geteuid() != 0:
        return "network namespaces and sshd need root"
    for tool in ("ip", "sshfs", "ssh", "ssh-keygen", "fusermount3", SSHD, SFTP_SERVER):
        if not shutil.which(tool):
            return "%s is not installed (iproute2, sshfs, openssh-server)" % tool
    probe = "kc-probe-%d" % os.getpid()
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return "cannot create a network namespace: %s" % r.stderr.strip()
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def mounted():
    """Mountpoints of this mount namespace."""
    with open("/proc/self/mounts") as f:
        return {line.split()[1] for line in f}


def run(*args, **kw):
    return subprocess.run(list(args), check=True, capture_output=True, text=True, **kw)


class SshfsExport:
    """export (a directory here) mounted over sshfs at mnt; tag names the namespaces."""

    made = 0  # exports of this process, for unique namespace names

    def __init__(self, tmp, tag=None, attr_timeout=30, entry_timeout=30):
        self.tmp = Path(tmp)
        SshfsExport.made += 1
        self.tag = tag or "%d-%d" % (os.getpid(), SshfsExport.made)
        self.srv = "kc-srv-" + self.tag
        self.cli = "kc-cli-" + self.tag
        self.export = self.tmp / "export"
        self.mnt = self.tmp / "sshfs"
        self.attr_timeout = attr_timeout
        self.entry_timeout = entry_timeout
        self.sshd = None
        self.sshfs = None
        self.namespaces = []

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        self.export.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(exist_ok=True)
        self.keys()
        for ns in (self.srv, self.cli):
            run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
        # made inside the namespaces: the link never exists here, so fixed names do
        run("ip", "link", "add", "kc-srv", "netns", self.srv, "type", "veth",
            "peer", "name", "kc-cli", "netns", self.cli)
        for ns, dev, addr in ((self.srv, "kc-srv", SERVER_ADDR), (self.cli, "kc-cli", CLIENT_ADDR)):
            run("ip", "-n", ns, "addr", "add", addr + "/30", "dev", dev)
            run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        self.start_sshd()
        self.mount()
        return self

    def keys(self):
        for name in ("host", "client"):
            key = self.tmp / name
            if not key.exists():
                run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kcachefs-test",
                    "-f", str(key))
        shutil.copy(self.tmp / "client.pub", self.tmp / "authorized_keys")
        self.config = self.tmp / "sshd_config"
        self.config.write_text(
            "ListenAddress %s:22\nHostKey %s\nAuthorizedKeysFile %s\nPidFile none\n"
            # the temp directory sits under world-writable /tmp, which StrictModes refuses
            "StrictModes no\nPermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "Subsystem sftp %s\nLogLevel VERBOSE\n"
            % (SERVER_ADDR, self.tmp / "host", self.tmp / "authorized_keys", SFTP_SERVER))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)

    def start_sshd(self):
        self.sshd_log = self.tmp / "sshd.log"
        self.sshd = subprocess.Popen(
            ["ip", "netns", "exec", self.srv, SSHD, "-D", "-e", "-f", str(self.config)],
            stdout=subprocess.DEVNULL, stderr=open(self.sshd_log, "ab"))

        def listening():
            assert self.sshd.poll() is None, "sshd exited: " + self.sshd_log.read_text()
            return "Server listening" in self.sshd_log.read_text()
        wait_until(listening, lambda: "sshd did not listen: " + self.sshd_log.read_text(),
                   READY_WAIT)

    def mount(self):
        ssh = "ip netns exec %s ssh" % self.cli
        self.sshfs_log = self.tmp / "sshfs.log"
        opts = ("ssh_command=%s,IdentityFile=%s,StrictHostKeyChecking=no,"
                "UserKnownHostsFile=/dev/null,LogLevel=ERROR,ConnectTimeout=10,"
                "ServerAliveInterval=15,ServerAliveCountMax=4,reconnect,cache=yes,attr_timeout=%d,"
                "entry_timeout=%d,negative_timeout=%d"
                % (ssh, self.tmp / "client", self.attr_timeout, self.entry_timeout,
                   self.entry_timeout))
        self.sshfs = subprocess.Popen(
            ["sshfs", "-f", "-o", opts, "root@%s:%s" % (SERVER_ADDR, self.export),
             str(self.mnt)], stdout=subprocess.DEVNULL, stderr=open(self.sshfs_log, "ab"))

        def mounted():
            assert self.sshfs.poll() is None, "sshfs exited: " + self.sshfs_log.read_text()
            return os.path.ismount(self.mnt)
        wait_until(mounted, "sshfs did not mount", READY_WAIT)

    def server_pids(self):
        """Every process in the server namespace (sshd and its sessions)."""
        r = subprocess.run(["ip", "netns", "pids", self.srv], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def kill_server(self):
        """SIGKILL sshd and its sessions: the connection drops under the mount."""
        for pid in self.server_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.sshd is not None:
            self.sshd.wait(timeout=60)

    def stop(self):
        try:
            self.unmount()
        finally:
            self.stop_server()

    def unmount(self):
        if str(self.mnt) in mounted():  # os.path.ismount fails on a dead sshfs
            if subprocess.run(["fusermount3", "-u", str(self.mnt)],
                              capture_output=True).returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.sshfs is not None:
            try:
                self.sshfs.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.sshfs.kill()
                self.sshfs.wait(timeout=30)
            self.sshfs = None

    def stop_server(self):
        """Kill every process of both namespaces (sshd, its sessions, ssh) by pid, then
        delete the namespaces and with them the veth pair."""
        for ns in self.namespaces:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.sshd is not None:
            if self.sshd.poll() is None:
                self.sshd.kill()
            self.sshd.wait(timeout=60)
            self.sshd = None
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.namespaces = []
