"""The hostile-program suite: programs that try to escape ``selfrl.envs.sandbox``, and the host checks.

Each program is Python source run with ``Sandbox.run_python``; it gets the
host's facts (paths, a pid, a port) as ``sys.argv[1]`` (JSON) and tries its
attack. Containment is judged on the host, never on the program's word:

* every run: the planted host file is byte-identical, nothing appeared in the
  host's ``/tmp`` or beside the planted file, the victim process (a ``sleep``
  owned by the host) is alive, the host's TCP/UDP listeners (on 0.0.0.0, so
  reachable at 127.0.0.1 and the host's own address) received nothing, no
  process carrying the run's marker survives the run, and the run ended
  within ``wall_seconds`` + 5 s;
* per program: the planted secret (a random token in a world-readable host
  file and in the host's environment) is not in the output, the output is
  capped, the write was bounded.

``python -m selfrl.envs.sandbox_suite [--isolation bwrap|rlimit]`` prints the table
(``scripts/sandbox_hostile.py`` does the same); ``tests/test_sandbox.py`` asserts
0 escapes under bwrap and the documented escapes of the rlimit fallback.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from selfrl.envs.sandbox import ExecResult, Limits, Sandbox, SandboxError

__all__ = ["HOSTILE", "Hostile", "HostFixture", "SuiteRow", "run_suite", "format_table"]

_PRELUDE = "import json, os, sys\nH = json.loads(sys.argv[1])\n"


@dataclass(frozen=True)
class Hostile:
    """One hostile program.

    Attributes:
        name: short name (table row).
        tries: what it attempts, in words.
        code: Python source; ``H`` (the host facts dict) is defined before it runs.
        check: extra host-side check ``(fixture, result) -> escape description | None``.
    """

    name: str
    tries: str
    code: str
    check: Callable[[HostFixture, ExecResult], str | None] | None = None


def _secret_leaked(fx: HostFixture, res: ExecResult) -> str | None:
    if fx.token in res.stdout or fx.token in res.stderr:
        return "the host's secret token appeared in the program's output"
    return None


def _output_capped(fx: HostFixture, res: ExecResult) -> str | None:
    if len(res.stdout.encode()) + len(res.stderr.encode()) > fx.limits.max_output_bytes:
        return "more output than max_output_bytes came back"
    if res.killed is None:
        return "a 200 MB print ran to its end"
    return None


def _memory_refused(fx: HostFixture, res: ExecResult) -> str | None:
    if "ALLOCATED" in res.stdout:
        return "10 GiB were allocated"
    return None


def _disk_bounded(fx: HostFixture, res: ExecResult) -> str | None:
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("WROTE ")]
    wrote = int(lines[-1].split()[1]) if lines else 0
    bound = fx.limits.file_size_bytes if res.isolation == "rlimit" else fx.limits.disk_bytes
    if wrote > bound:
        return f"wrote {wrote} bytes, more than the {bound} allowed"
    return None


def _threads_bounded(fx: HostFixture, res: ExecResult) -> str | None:
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("THREADS ")]
    n = int(lines[-1].split()[1]) if lines else 0
    if n > fx.limits.max_processes:
        return f"started {n} threads, more than max_processes={fx.limits.max_processes}"
    return None


def _stayed_unprivileged(fx: HostFixture, res: ExecResult) -> str | None:
    if "BECAME ROOT" in res.stdout:
        return "the program gained uid 0 outside a user namespace"
    return None


def _nothing_written(fx: HostFixture, res: ExecResult) -> str | None:
    wrote = [ln.split(" ", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("WROTE ")]
    return f"wrote outside its own directories: {wrote}" if wrote else None


HOSTILE: tuple[Hostile, ...] = (
    Hostile("fork_bomb", "fork without end", "while True:\n    os.fork()\n"),
    Hostile("infinite_loop", "spin the CPU forever", "while True:\n    pass\n"),
    Hostile("alloc_10gb", "allocate 10 GiB at once",
            "b = bytearray(10 * 2**30)\nprint('ALLOCATED')\n", _memory_refused),
    Hostile("alloc_in_processes", "8 processes each allocating 4 GiB",
            "for _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(4 * 2**30)\n"
            "        print('ALLOCATED', flush=True)\n        os._exit(0)\n"
            "for _ in range(8):\n    os.wait()\n", _memory_refused),
    Hostile("write_outside", "overwrite a host file, create files beside it, in /etc and in ..",
            "for p, mode in ((H['host_file'], 'w'), (H['beside'], 'w'), ('/etc/selfrl-pwned', 'w'),\n"
            "                (os.path.join(os.getcwd(), '..', 'selfrl-pwned'), 'w')):\n"
            "    try:\n        open(p, mode).write('pwned')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('refused', p, e)\n"),
    Hostile("fill_unsized_mounts", "write into /, /dev, /usr and /etc (mounts without a size limit)",
            "for p in ('/selfrl-fill', '/dev/selfrl-fill', '/usr/selfrl-fill', '/etc/selfrl-fill'):\n"
            "    try:\n        open(p, 'wb').write(b'x' * 2**20)\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('refused', p, e)\n", _nothing_written),
    Hostile("write_host_tmp", "create a file in the host's /tmp",
            "try:\n    open(H['host_tmp_target'], 'w').write('pwned')\n"
            "except OSError as e:\n    print('refused', e)\n"),
    Hostile("read_host_secret", "read a world-readable secret file, /etc/shadow, the host's /proc",
            "for p in (H['secret_path'], '/etc/shadow', '/etc/passwd', f\"/proc/{H['host_pid']}/environ\",\n"
            "          '/proc/1/environ'):\n"
            "    try:\n        print(p, open(p, 'rb').read()[:4000])\n"
            "    except OSError as e:\n        print('refused', p, e)\n", _secret_leaked),
    Hostile("read_environment", "read the environment for host secrets",
            "print(dict(os.environ))\n", _secret_leaked),
    Hostile("socket_loopback", "connect to the host's TCP and UDP listeners on 127.0.0.1",
            "import socket\n"
            "for fam in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n"
            "    try:\n        s = socket.socket(socket.AF_INET, fam)\n        s.settimeout(2)\n"
            "        s.connect(('127.0.0.1', H['tcp_port'] if fam == socket.SOCK_STREAM else H['udp_port']))\n"
            "        s.send(b'pwned')\n        print('SENT', fam)\n"
            "    except OSError as e:\n        print('refused', e)\n"),
    Hostile("socket_other", "reach the host's own address, a public DNS server, and resolve a name",
            "import socket\n"
            "for addr in ((H['host_ip'], H['tcp_port']), ('1.1.1.1', 53), ('8.8.8.8', 53)):\n"
            "    try:\n        s = socket.create_connection(addr, timeout=2)\n        s.send(b'pwned')\n"
            "        print('CONNECTED', addr)\n    except OSError as e:\n        print('refused', addr, e)\n"
            "try:\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "    s.sendto(b'pwned', (H['host_ip'], H['udp_port']))\nexcept OSError as e:\n"
            "    print('refused udp', e)\n"
            "try:\n    print(socket.gethostbyname('example.com'))\nexcept OSError as e:\n"
            "    print('refused dns', e)\n"),
    Hostile("signal_parent", "SIGKILL its parent, the host's pid, its process group and -1",
            "import signal\n"
            "for pid in (os.getppid(), H['host_pid'], -os.getpgrp(), -1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('SIGNALLED', pid)\n"
            "    except OSError as e:\n        print('refused', pid, e)\n"),
    Hostile("kill_other_process", "SIGKILL a host process (by pid) and every pid it can see",
            "import signal\n"
            "try:\n    os.kill(H['victim_pid'], signal.SIGKILL)\nexcept OSError as e:\n    print('refused', e)\n"
            "for p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
            "        try:\n            os.kill(int(p), signal.SIGKILL)\n        except OSError:\n            pass\n"),
    Hostile("huge_output", "print 200 MB", "sys.stdout.write('x' * (200 * 2**20))\n", _output_capped),
    Hostile("disk_fill", "write 1 GiB into its own directory",
            "n = 0\ntry:\n    with open('fill', 'wb') as f:\n        for _ in range(1024):\n"
            "            f.write(b'x' * 2**20)\n            n += 2**20\n            f.flush()\n"
            "except OSError as e:\n    print('refused', e)\nprint('WROTE', n)\n", _disk_bounded),
    Hostile("thread_bomb", "start 10,000 threads",
            "import threading, time\nn = 0\ntry:\n    for _ in range(10000):\n"
            "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
            "except RuntimeError as e:\n    print('refused', e)\nprint('THREADS', n, flush=True)\nos._exit(0)\n",
            _threads_bounded),
    Hostile("orphan_daemon", "double-fork into a new session and outlive the run",
            "import time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(600)\n"
            "    os._exit(0)\nprint('parent exits')\n"),
    Hostile("become_root", "setuid(0), chroot and mount",
            "try:\n    os.setuid(0)\n    os.chroot('/')\n    open('/usr/selfrl-pwned', 'w').write('x')\n"
            "    print('BECAME ROOT')\nexcept OSError as e:\n    print('refused', e)\n", _stayed_unprivileged),
)


@dataclass
class HostFixture:
    """The host side of the suite: planted files, a victim process, listeners. Use as a context.

    Attributes:
        limits: the limits the suite runs under.
        token: the secret planted in ``secret_path`` and in ``os.environ``.
        root: host directory holding the planted files (removed on exit).
    """

    limits: Limits
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="selfrl-hostile-")))
    received: list[bytes] = field(default_factory=list)

    def __enter__(self) -> HostFixture:
        for p in Path(tempfile.gettempdir()).glob("selfrl-pwned*"):  # left by an earlier, killed run
            p.unlink()
        os.chmod(self.root, 0o755)
        self.secret_path = self.root / "secret.txt"
        self.secret_path.write_text(f"SECRET {self.token}\n")
        os.chmod(self.secret_path, 0o644)  # world-readable: the worst case
        self.host_file = self.root / "host_file.txt"
        self.host_file.write_text("original\n")
        self.host_bytes = self.host_file.read_bytes()
        self.beside = self.root / "beside.txt"
        self.host_tmp_target = Path(tempfile.gettempdir()) / f"selfrl-pwned-{self.token[:8]}"
        self._env_key = "SELFRL_HOSTILE_SECRET"
        os.environ[self._env_key] = self.token
        self.victim = subprocess.Popen(["sleep", "600"])
        self._tcp = socket.socket()
        self._tcp.bind(("0.0.0.0", 0))
        self._tcp.listen()
        self._tcp.settimeout(0.2)
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._udp.bind(("0.0.0.0", 0))
        self._udp.settimeout(0.2)
        self._stop = threading.Event()
        # not joined at exit (selfrl.core.threads_at_exit): sockets only, and __exit__ joins it
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()
        return self

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._tcp.accept()
                self.received.append(b"tcp:" + conn.recv(100))
                conn.close()
            except OSError:
                pass
            try:
                self.received.append(b"udp:" + self._udp.recv(100))
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._tcp.close()
        self._udp.close()
        self.victim.kill()
        self.victim.wait()
        os.environ.pop(self._env_key, None)
        for p in sorted(self.root.iterdir()):
            p.unlink()
        self.root.rmdir()

    def facts(self) -> dict:
        """What the programs are told about the host (``sys.argv[1]``)."""
        return {"secret_path": str(self.secret_path), "host_file": str(self.host_file),
                "beside": str(self.beside), "host_tmp_target": str(self.host_tmp_target),
                "victim_pid": self.victim.pid, "host_pid": os.getpid(), "host_ip": _host_ip(),
                "tcp_port": self._tcp.getsockname()[1], "udp_port": self._udp.getsockname()[1]}

    def host_escapes(self, res: ExecResult, marker: str) -> list[str]:
        """The host-side checks common to every program (see the module docstring)."""
        time.sleep(0.3)  # let a datagram or connection that got through land
        found = []
        if self.host_file.read_bytes() != self.host_bytes:
            found.append("the planted host file changed")
            self.host_file.write_bytes(self.host_bytes)
        if self.beside.exists():
            found.append("a file appeared beside the planted file")
            self.beside.unlink()
        pwned = sorted(Path(tempfile.gettempdir()).glob("selfrl-pwned*"))
        if pwned:
            found.append(f"{len(pwned)} file(s) appeared in the host's /tmp")
            for p in pwned:  # reset, so that the next program is judged on its own
                p.unlink()
        if Path("/etc/selfrl-pwned").exists() or Path("/usr/selfrl-pwned").exists():
            found.append("a file appeared in /etc or /usr")
        if self.victim.poll() is not None:
            found.append("the victim process was killed")
            self.victim = subprocess.Popen(["sleep", "600"])
        if self.received:
            found.append(f"the host listeners received {self.received!r}")
        survivors = _processes_with(marker)
        if survivors:
            found.append(f"{len(survivors)} process(es) outlived the run")
            _kill_pids(survivors)
        if res.wall_seconds > self.limits.wall_seconds + 5:
            found.append(f"the run took {res.wall_seconds:.1f} s, past the wall limit")
        return found


def _host_ip() -> str:
    """The host's own non-loopback IPv4 address (127.0.0.1 when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing address
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


@dataclass(frozen=True)
class SuiteRow:
    """One program's outcome: ``escapes`` is empty when it was contained."""

    name: str
    tries: str
    outcome: str
    escapes: tuple[str, ...]
    wall_seconds: float

    @property
    def contained(self) -> bool:
        return not self.escapes


def _outcome(res: ExecResult) -> str:
    """The exit, the last line of stderr (an exception) and how many attempts the program saw refused."""
    if res.killed:
        return f"killed: {res.killed}"
    err = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    out = res.stdout.splitlines()
    refused = [ln for ln in out if ln.startswith("refused")]
    said = [ln for ln in out if ln.startswith(("WROTE ", "THREADS "))]
    parts = [f"exit {res.exit_code}"]
    if err:
        parts.append(err[-1][:50])
    if refused:
        parts.append(f"{len(refused)} refused, e.g. {refused[0][:60]}")
    if said:
        parts.append(said[-1][:40])
    return "; ".join(parts)


def run_suite(sandbox: Sandbox, programs: tuple[Hostile, ...] = HOSTILE) -> list[SuiteRow]:
    """Run every hostile program in ``sandbox`` and judge containment on the host.

    Raises:
        SandboxError: the rlimit fallback without root: the programs would run as
            the caller and could kill its processes and overwrite its files.
    """
    if sandbox.isolation == "rlimit" and os.geteuid() != 0:
        raise SandboxError("the hostile suite under the rlimit fallback needs root (a fresh uid per "
                           "program); as this user the programs could kill your processes")
    rows = []
    with HostFixture(sandbox.limits) as fx:
        for prog in programs:
            facts = json.dumps(fx.facts())
            marker = f"selfrl-hostile-{secrets.token_hex(6)}"
            res = sandbox.run_python(_PRELUDE + prog.code, args=[facts, marker])
            escapes = fx.host_escapes(res, marker)
            extra = prog.check(fx, res) if prog.check else None
            if extra:
                escapes.append(extra)
            rows.append(SuiteRow(prog.name, prog.tries, _outcome(res), tuple(escapes), res.wall_seconds))
            fx.received.clear()
    return rows


def format_table(rows: list[SuiteRow], sandbox: Sandbox) -> str:
    """A markdown table of the rows, with the isolation level and limits above it."""
    lim = sandbox.limits
    head = [f"isolation: {sandbox.isolation}" + (f" (fallback: {sandbox.fallback_reason})"
                                                 if sandbox.fallback_reason else ""),
            f"limits: wall {lim.wall_seconds:g} s, cpu {lim.cpu_limit} s, memory {lim.memory_bytes // 2**20} MiB"
            f"/process, {lim.max_processes} processes, file {lim.file_size_bytes // 2**20} MiB, "
            f"disk {lim.disk_bytes // 2**20} MiB, output {lim.max_output_bytes // 2**10} KiB",
            "", "| program | tries | outcome | contained | wall s |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "yes" if r.contained else "NO: " + "; ".join(r.escapes)
        head.append(f"| {r.name} | {r.tries} | {r.outcome.replace('|', '/')} | {verdict} | {r.wall_seconds:.2f} |")
    n_esc = sum(not r.contained for r in rows)
    head.append("")
    head.append(f"{len(rows)} programs, {n_esc} escapes, host unchanged: {'yes' if n_esc == 0 else 'NO'}")
    return "\n".join(head)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "rlimit"))
    ap.add_argument("--wall-seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    sandbox = Sandbox(Limits(wall_seconds=args.wall_seconds), isolation=args.isolation)
    t0 = time.monotonic()
    rows = run_suite(sandbox)
    print(format_table(rows, sandbox))
    print(f"suite wall time {time.monotonic() - t0:.1f} s")
    return 0 if all(r.contained for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
