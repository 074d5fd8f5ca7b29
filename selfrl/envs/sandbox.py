"""Run untrusted (model-written) programs: no network, bounded time/memory/processes/output.

Every execution of model-written code in selfrl goes through ``Sandbox.run`` or
``Sandbox.run_python``. Two isolation levels exist, and the result always says
which one ran (``ExecResult.isolation``); neither is chosen silently.

``"bwrap"`` (bubblewrap, Debian package ``bubblewrap``), used whenever it works:
    * new user, pid, network, ipc, uts and cgroup namespaces (``--unshare-all``);
      the network namespace has only a loopback of its own, so no host or
      internet address is reachable; the program cannot see or signal host
      processes (its ``/proc`` shows only its own);
    * the file system is a fresh, read-only root: ``/usr`` (+ the ``/bin``,
      ``/lib*`` links) and the interpreter's prefix read-only, a minimal
      ``/dev`` and ``/proc``; everything else of the host (``/etc``, ``/home``, ``/root``,
      ``/work``, the host's ``/tmp``) is invisible;
    * its own writable directory ``/sandbox`` (the cwd), ``/tmp`` and
      ``/dev/shm``: tmpfs mounts of ``Limits.disk_bytes`` each (nothing else is
      writable), gone when the run ends, so the host
      disk is never written;
    * all capabilities dropped, no nested user namespaces (``--disable-userns``),
      a new session (``--new-session``, no terminal injection), killed if its
      parent dies (``--die-with-parent``); on a timeout the outer bwrap is
      killed, which kills the namespace's pid 1 and with it, by the kernel,
      every process in the namespace;
    * plus the rlimits below.

``"rlimit"``, the documented weaker fallback where bwrap cannot run (no
package, user namespaces disabled):
    * a fresh session (``setsid``) in a fresh temporary directory as cwd and
      ``HOME``/``TMPDIR``, the environment scrubbed to ``PATH``/``HOME``/
      ``TMPDIR``/``LANG``, and the rlimits below;
    * when selfrl runs as root, the program runs as a fresh unprivileged uid
      (random in ``[3_000_000, 4_000_000)``), so it cannot write root-owned
      files, cannot signal the host's processes, and the process limit counts
      only its own processes; on timeout every process of that uid is killed.
    * It does NOT protect: the network (sockets open freely, loopback and
      internet); reading any world-readable host file (``/etc/passwd``, the
      repository if world-readable); writing world-writable places (the host's
      ``/tmp``, ``/dev/shm``); disk use beyond one file (each file is capped by
      ``file_size_bytes``, their number is not). Not running as root, it also
      cannot switch uid: the program then runs as the caller's user and CAN
      signal (kill) the caller and its other processes, and read and write
      every file the caller can.

The rlimits (both levels): ``RLIMIT_AS`` = ``memory_bytes`` per process,
``RLIMIT_CPU`` = ``cpu_seconds`` per process, ``RLIMIT_NPROC`` =
``max_processes`` (counted per uid; for a non-root caller without a fresh uid
the caller's current process count is added, see ``_nproc_limit``),
``RLIMIT_FSIZE`` = ``file_size_bytes``, ``RLIMIT_NOFILE`` = ``open_files``,
``RLIMIT_CORE`` = 0. Total memory is bounded by ``max_processes *
memory_bytes`` (no cgroup is used: this machine's cgroup tree is read-only).
The wall clock (``wall_seconds``) and the output size (``max_output_bytes``)
are enforced by the caller, which kills the whole run when either is exceeded.

The hostile-program suite (``tests/test_sandbox.py``, ``scripts/sandbox_hostile.py``,
figures in ``docs/concepts/sandbox.md``) checks both levels.

One module of about 590 lines, past the 500 we aim for, on purpose: everything that stands
between model-written code and the host (the bwrap arguments, the rlimits, the fresh uid, the
output and wall-clock bounds, killing every process of a run) is read and reviewed in one place.
"""

from __future__ import annotations

import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "ExecResult",
    "Isolation",
    "Limits",
    "Sandbox",
    "SandboxError",
    "bwrap_problem",
]

Isolation = Literal["bwrap", "rlimit"]
_CHOICES = ("auto", "bwrap", "rlimit")
_WORKDIR = "/sandbox"  # the program's cwd inside bwrap
_UID_RANGE = (3_000_000, 4_000_000)  # fresh uids for a root caller
_ENV_BASE = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


class SandboxError(RuntimeError):
    """The sandbox cannot run as asked (bwrap required but unusable, bad input)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. Every field is enforced (see the module docstring).

    Attributes:
        wall_seconds: wall-clock limit of the whole run (seconds); then everything is killed.
        cpu_seconds: CPU time per process (seconds, ``RLIMIT_CPU``); None: ceil(wall_seconds).
        memory_bytes: address space per process (bytes, ``RLIMIT_AS``).
        max_processes: processes + threads the program may have at once (``RLIMIT_NPROC``).
        file_size_bytes: largest file the program may write (bytes, ``RLIMIT_FSIZE``).
        disk_bytes: size of each writable tmpfs: ``/sandbox``, ``/tmp``, ``/dev/shm`` (bytes; bwrap only).
        open_files: open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: stdout + stderr kept (bytes); more kills the run (``killed="output_limit"``).
    """

    wall_seconds: float = 10.0
    cpu_seconds: int | None = None
    memory_bytes: int = 512 * 2**20
    max_processes: int = 64
    file_size_bytes: int = 16 * 2**20
    disk_bytes: int = 64 * 2**20
    open_files: int = 256
    max_output_bytes: int = 2**20

    def __post_init__(self):
        if not self.wall_seconds > 0:
            raise ValueError(f"wall_seconds must be > 0, got {self.wall_seconds}")
        for name in ("memory_bytes", "max_processes", "file_size_bytes", "disk_bytes",
                     "open_files", "max_output_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_seconds is not None and self.cpu_seconds < 1:
            raise ValueError(f"cpu_seconds must be >= 1 or None, got {self.cpu_seconds}")

    @property
    def cpu_limit(self) -> int:
        """``RLIMIT_CPU`` in seconds: ``cpu_seconds``, or the wall limit rounded up."""
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.wall_seconds)


@dataclass(frozen=True)
class ExecResult:
    """What one sandboxed run produced.

    Attributes:
        stdout: standard output (UTF-8, undecodable bytes replaced), at most
            ``Limits.max_output_bytes`` bytes together with stderr.
        stderr: standard error, same rules.
        exit_code: the program's exit status; a program killed by signal N
            reports 128 + N under bwrap and -N under the fallback. None when the
            sandbox killed it (``killed`` says why).
        timed_out: True when the wall-clock limit was reached.
        killed: why the sandbox killed the run: "timeout" or "output_limit"; None if it exited.
        wall_seconds: wall-clock duration of the run (seconds), sandbox start-up included.
        isolation: "bwrap" or "rlimit" (see the module docstring for what each protects).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    killed: str | None
    wall_seconds: float
    isolation: Isolation

    @property
    def ok(self) -> bool:
        """True when the program exited by itself with status 0."""
        return self.exit_code == 0 and self.killed is None

    def as_tool_output(self, max_chars: int = 2000) -> str:
        r"""What a ``run_python`` tool shows the model: the exit, then stdout and stderr, cut to ``max_chars``.

        >>> ExecResult("4\n", "", 0, False, None, 0.1, "bwrap").as_tool_output()
        'exit code 0\nstdout:\n4\n'
        >>> ExecResult("", "", None, True, "timeout", 10.0, "bwrap").as_tool_output()
        'killed: timeout (after 10.0 s)\n'
        """
        head = (f"killed: {self.killed} (after {self.wall_seconds:.1f} s)" if self.killed
                else f"exit code {self.exit_code}")
        text = head + "\n"
        if self.stdout:
            text += "stdout:\n" + self.stdout
        if self.stderr:
            text += ("" if text.endswith("\n") else "\n") + "stderr:\n" + self.stderr
        if len(text) > max_chars:
            text = text[: max_chars - 20] + f"\n[... {len(text) - max_chars + 20} chars cut]"
        return text


@dataclass
class _Probe:
    lock: threading.Lock = field(default_factory=threading.Lock)
    result: dict[str, str | None] = field(default_factory=dict)


_PROBE = _Probe()


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate a program here, or None when it can.

    Runs ``print(1)`` under the exact bwrap command line ``Sandbox`` uses, once
    per process (the answer is cached). Reasons include "bwrap not found on
    PATH" and bwrap's own error (e.g. user namespaces disabled).
    """
    with _PROBE.lock:
        if "bwrap" not in _PROBE.result:
            _PROBE.result["bwrap"] = _probe_bwrap()
        return _PROBE.result["bwrap"]


def _probe_bwrap() -> str | None:
    if shutil.which("bwrap") is None:
        return "bwrap not found on PATH (Debian: apt-get install -y bubblewrap)"
    try:
        res = Sandbox(Limits(wall_seconds=30.0), isolation="bwrap", _probe=True).run_python("print(1)")
    except (OSError, SandboxError) as e:
        return f"bwrap failed to start: {e}"
    if res.stdout.strip() != "1" or res.exit_code != 0:
        return f"bwrap test run failed (exit {res.exit_code}): {res.stderr.strip()[-500:]}"
    return None


def _fresh_uid() -> int | None:
    """A fresh unprivileged uid for the program when we are root, else None."""
    if os.geteuid() != 0:
        return None
    return _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])


def _count_processes(uid: int) -> int:
    """Live processes and threads (tasks) whose real uid is ``uid``, from /proc (zombies left out)."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            n += int(fields.get("Threads", "1").strip())
    return n


def _nproc_limit(limits: Limits, uid: int | None) -> int:
    """``RLIMIT_NPROC`` to set: exact for a fresh uid, else offset by the caller's own count.

    The kernel counts processes per real uid, so a non-root caller that cannot
    switch uid gets ``max_processes`` on top of what it already runs.
    """
    if uid is not None:
        return limits.max_processes
    return _count_processes(os.getuid()) + limits.max_processes


def _reachable_by_others(path: Path) -> bool:
    """True when a stranger uid can traverse to and execute ``path``."""
    path = path.resolve()
    for parent in path.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IXOTH and mode & stat.S_IROTH)


def _default_python(uid: int | None) -> tuple[str, str | None]:
    """(interpreter path, prefix to bind read-only or None) for ``run_python``.

    The caller's own interpreter (``sys.base_prefix``, stdlib only, never the
    virtualenv's packages) when the program's uid can reach it, else the
    system's ``/usr/bin/python3``.
    """
    prefix = Path(sys.base_prefix)
    exe = prefix / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if exe.exists() and (uid is None or _reachable_by_others(exe)):
        return str(exe), (None if str(prefix).startswith("/usr") else str(prefix))
    system = Path("/usr/bin/python3")
    if system.exists() and _reachable_by_others(system):
        return str(system), None
    raise SandboxError(
        f"no Python interpreter the sandboxed uid can execute: {exe} is not reachable by "
        "other users and /usr/bin/python3 does not exist; pass python= to Sandbox")


def _check_names(files: Mapping[str, str | bytes]) -> None:
    for name in files:
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise SandboxError(f"file names must be plain names without '/', got {name!r}")


class Sandbox:
    """Runs programs isolated and limited (see the module docstring).

    Args:
        limits: the limits of every run (``Limits()`` when None).
        isolation: "auto" (bwrap when ``bwrap_problem()`` is None, else the
            rlimit fallback with a RuntimeWarning and the reason in ``self.fallback_reason``),
            "bwrap" (raise ``SandboxError`` if bwrap cannot run) or "rlimit".
        python: interpreter for ``run_python``; default: the caller's base
            interpreter when the sandboxed uid can reach it, else /usr/bin/python3.

    Raises:
        ValueError: an unknown ``isolation``.
        SandboxError: "bwrap" asked for but unusable (the message says why).
    """

    def __init__(self, limits: Limits | None = None, isolation: str = "auto",
                 python: str | None = None, *, _probe: bool = False):
        if isolation not in _CHOICES:
            raise ValueError(f"isolation must be one of {_CHOICES}, got {isolation!r}")
        self.limits = limits or Limits()
        self.fallback_reason: str | None = None
        if isolation == "auto":
            self.fallback_reason = bwrap_problem()
            isolation = "rlimit" if self.fallback_reason else "bwrap"
            if self.fallback_reason:
                warnings.warn(f"sandbox: bubblewrap cannot run ({self.fallback_reason}); model-written "
                              "code runs under the weaker rlimit fallback, with network and host files "
                              "reachable (docs/concepts/sandbox.md)", RuntimeWarning, stacklevel=2)
        elif isolation == "bwrap" and not _probe:
            problem = bwrap_problem()
            if problem:
                raise SandboxError(f"isolation='bwrap' asked for, but {problem}")
        self.isolation: Isolation = isolation  # type: ignore[assignment]
        self._python = python

    # -- public API ---------------------------------------------------------------------------

    def run_python(self, code: str, *, stdin: str | bytes = b"",
                   files: Mapping[str, str | bytes] | None = None,
                   args: Sequence[str] = ()) -> ExecResult:
        """Run Python source ``code`` (saved as ``main.py`` in the program's directory).

        ``files`` are put beside it (plain names only); ``args`` go to ``sys.argv[1:]``.
        The interpreter ignores ``PYTHON*`` variables and the user site (``-E -s``).
        """
        files = dict(files or {})
        if "main.py" in files:
            raise SandboxError("files may not contain 'main.py': run_python writes the code there")
        files["main.py"] = code
        return self._run(None, ["-E", "-s", "main.py", *args], files, stdin)

    def run(self, argv: Sequence[str], *, stdin: str | bytes = b"",
            files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        """Run ``argv`` (an absolute path, or a name on ``/usr/bin:/bin``) in the sandbox.

        ``files`` ({plain name: content}) are written into the program's
        directory (its cwd) before it starts.

        Raises:
            SandboxError: an empty argv or a file name with '/'.
        """
        if not argv:
            raise SandboxError("argv is empty")
        return self._run(argv[0], list(argv[1:]), dict(files or {}), stdin)

    # -- internals ----------------------------------------------------------------------------

    def _run(self, exe: str | None, args: list[str], files: dict[str, str | bytes],
             stdin: str | bytes) -> ExecResult:
        _check_names(files)
        uid = _fresh_uid()
        prefix = None
        if exe is None:
            exe, prefix = (self._python, None) if self._python else _default_python(uid)
        nproc = _nproc_limit(self.limits, uid)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        if self.isolation == "bwrap":
            return self._run_bwrap(exe, args, files, data, uid, prefix, nproc)
        return self._run_rlimit(exe, args, files, data, uid, nproc)

    def _rlimits(self, nproc: int) -> list[tuple[str, int, int]]:
        """(prlimit option, resource, value) of every limit set on the run."""
        lim = self.limits
        return [("as", resource.RLIMIT_AS, lim.memory_bytes), ("cpu", resource.RLIMIT_CPU, lim.cpu_limit),
                ("nproc", resource.RLIMIT_NPROC, nproc), ("fsize", resource.RLIMIT_FSIZE, lim.file_size_bytes),
                ("nofile", resource.RLIMIT_NOFILE, lim.open_files), ("core", resource.RLIMIT_CORE, 0)]

    def _limited(self, argv: list[str], nproc: int):
        """(argv, preexec_fn): util-linux ``prlimit`` in front of argv where it exists, which keeps
        Python code out of the fork (``preexec_fn`` is not safe in a threaded caller), else a preexec_fn."""
        limits = self._rlimits(nproc)
        prlimit = shutil.which("prlimit", path="/usr/bin:/bin")
        if prlimit:
            return [prlimit, *(f"--{opt}={value}" for opt, _, value in limits), "--", *argv], None

        def apply() -> None:  # runs in the child between fork and exec (after setuid)
            for _, res, value in limits:
                resource.setrlimit(res, (value, value))

        return argv, apply

    def _bwrap_argv(self, exe: str, args: list[str], file_fds: dict[str, int],
                    prefix: str | None) -> list[str]:
        argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        if prefix:
            argv += ["--ro-bind", prefix, prefix]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(self.limits.disk_bytes), "--tmpfs", "/dev/shm",
                 "--size", str(self.limits.disk_bytes), "--tmpfs", "/tmp",
                 "--size", str(self.limits.disk_bytes), "--tmpfs", _WORKDIR]
        for name, fd in file_fds.items():
            argv += ["--file", str(fd), f"{_WORKDIR}/{name}"]
        # bwrap's root and /dev are tmpfs mounts without a size limit: no writes there
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        argv += ["--chdir", _WORKDIR, "--clearenv",
                 "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _WORKDIR,
                 "--setenv", "TMPDIR", "/tmp"]
        for key, value in _ENV_BASE.items():
            argv += ["--setenv", key, value]
        return argv + ["--", exe, *args]

    def _run_bwrap(self, exe, args, files, data, uid, prefix, nproc) -> ExecResult:
        fds: dict[str, int] = {}
        try:
            for name, content in files.items():
                fd = os.memfd_create(f"sandbox-{name}")
                os.write(fd, content.encode() if isinstance(content, str) else content)
                os.lseek(fd, 0, os.SEEK_SET)
                fds[name] = fd
            argv = self._bwrap_argv(exe, args, fds, prefix)
            return self._spawn(argv, None, None, data, uid, nproc, "bwrap", list(fds.values()))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run_rlimit(self, exe, args, files, data, uid, nproc) -> ExecResult:
        workdir = tempfile.mkdtemp(prefix="selfrl-sandbox-")
        try:
            for name, content in files.items():
                mode = "w" if isinstance(content, str) else "wb"
                with open(os.path.join(workdir, name), mode) as f:
                    f.write(content)
            if uid is not None:
                for p in [workdir, *(os.path.join(workdir, n) for n in files)]:
                    os.chown(p, uid, uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, **_ENV_BASE}
            return self._spawn([exe, *args], workdir, env, data, uid, nproc, "rlimit", [])
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _spawn(self, argv, cwd, env, data, uid, nproc, isolation, pass_fds) -> ExecResult:
        """Start ``argv`` in a new session and collect it; it is killed at the wall-clock limit.

        Raises:
            whatever collecting its output raised (e.g. ``KeyboardInterrupt``), after the run was killed and reaped.
        """
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        argv, preexec = self._limited(argv, nproc)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env if env is not None else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=preexec, pass_fds=pass_fds, close_fds=True, **ids)
        try:
            out, err, killed = self._communicate(proc, data, t0 + self.limits.wall_seconds)
        except BaseException:  # our side failed mid-run (an interrupt, a read error): the run must not outlive it
            _kill_everything(proc, uid)
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            raise
        if killed:
            _kill_everything(proc, uid)
        code = proc.wait()
        if uid is not None:
            _kill_uid(uid)  # stragglers that left the session (fallback) or outlived the run
        wall = time.monotonic() - t0
        return ExecResult(
            stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"),
            exit_code=None if killed else code, timed_out=killed == "timeout", killed=killed,
            wall_seconds=wall, isolation=isolation)

    def _communicate(self, proc, data: bytes, deadline: float) -> tuple[bytes, bytes, str | None]:
        """Feed stdin, collect output until both pipes close; stop at the deadline or output cap."""
        cap = self.limits.max_output_bytes
        chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
        total = 0
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        view = memoryview(data)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        killed = None
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    killed = "timeout"
                    break
                for key, _ in sel.select(timeout=min(remaining, 0.5)):
                    if key.fileobj is proc.stdin:
                        try:
                            n = os.write(proc.stdin.fileno(), view[:65536])
                        except (BrokenPipeError, BlockingIOError) as e:
                            n = 0 if isinstance(e, BlockingIOError) else len(view)
                        view = view[n:]
                        if not view:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    keep = chunk[: max(0, cap - total)]
                    chunks[key.fd].append(keep)
                    total += len(chunk)
                    if total > cap:
                        killed = "output_limit"
                if killed:
                    break
            if killed is None:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    killed = "timeout"
        finally:
            sel.close()
            if proc.stdin and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        out = b"".join(chunks[proc.stdout.fileno()])
        err = b"".join(chunks[proc.stderr.fileno()])
        proc.stdout.close()
        proc.stderr.close()
        return out, err, killed


def _kill_everything(proc: subprocess.Popen, uid: int | None) -> None:
    """SIGKILL the run: its session's process group, then (fresh uid) every process of that uid.

    Under bwrap, killing the outer bwrap kills the pid namespace's init and so,
    by the kernel, every process inside it.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose uid is ``uid`` (``kill -9 -1`` run as that uid).

    ``kill(-1, SIGKILL)`` reaches exactly the processes the sender may signal;
    a sender with real and effective uid ``uid`` and no capabilities may
    signal only processes of that uid. Repeated until none is left, since a
    fork bomb may fork between the rounds. The killer is started by
    ``subprocess`` (uid switched in C, no Python in the fork) where
    ``/usr/bin/kill`` or ``/bin/kill`` exists, else by ``os.fork``.
    """
    kill = shutil.which("kill", path="/usr/bin:/bin")
    for _ in range(50):
        if _count_processes(uid) == 0:
            return
        if kill:
            subprocess.run([kill, "-9", "--", "-1"], user=uid, group=uid, extra_groups=[],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        else:
            pid = os.fork()
            if pid == 0:  # child: drop to the uid and kill all it may kill; only os calls here
                try:
                    os.setgroups([])
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        time.sleep(0.01)
