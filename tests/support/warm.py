"""Warm interpreters for the suite's child processes: a zygote that has
imported torch once forks each `python ...` the tests start.

Every test process that starts Python (a torchrun agent, a notebook kernel,
`python -m dormouse ...`, a fault run) paid `import torch` afresh: 3.4 CPU-s
each on a 2-core CI machine without a warm page cache, about 100 of them a
suite run, a third of its CPU time. Here each pytest worker starts one zygote
(`serve`), which imports torch and its distributed launcher and then only
waits; `sys.executable` in the worker becomes a small client script
(`client_source`), so every `subprocess` call, torchrun launch and Jupyter
kernel that starts "python" reaches the zygote, which forks a child that
runs the command as the interpreter would (`-m mod`, `-c code`, a script,
with `-u`/`-B`). The child is the program; nothing in it is a stand-in.

What the child shares with a fresh interpreter, and what it does not:
- the client's argv, environment, working directory, umask and standard
  streams (passed as file descriptors) are the child's; its exit status,
  or the signal that ended it, is the client's;
- signals sent to the client (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2)
  go to the child's process group, as a `killpg` of the client's group
  would reach it; a client killed outright (SIGKILL) makes the child's
  group be killed the same way (its supervisor sees the connection close);
- NOT shared: the string-hash secret. Every child of one zygote hashes
  strings alike, as ranks forked from one torchrun agent do, and that
  includes the ranks of the gate's fleets of "one interpreter per rank"
  (an agent's children start warm too). The one test about what only
  separate interpreters show (tests/gate/record/test_launcher.py, a fault that
  orders gradients by string hash) starts its fleet with
  DORMOUSE_TEST_WARM=0 in the fleet's environment: the zygote declines a
  command whose environment says so, and the real Python runs it and,
  from it, every rank;
- a command the zygote cannot reproduce exactly (another option, or an
  environment that changes how an interpreter starts: PYTHON* variables
  other than PYTHONPATH / PYTHONUNBUFFERED / PYTHONDONTWRITEBYTECODE, a
  different OMP_NUM_THREADS, TORCH_*/LD_*/MKL_* settings but for
  TORCH_NCCL_*, which torchrun sets for its ranks and NCCL reads when a
  process group starts) is executed by
  the real Python instead, as is every command when the zygote is gone.

Other known differences (a review's; none is something a test here looks at):
- a client killed outright returns from wait() a moment before its child
  is gone (the supervisor kills it when it sees the connection close): a
  lock the child held may still be held just after;
- the caller's ignored signals, signal mask, CPU affinity, rlimits and nice
  value are not the child's (it starts with a fresh interpreter's); SIGSTOP
  and SIGCONT sent to the client do not reach the child; a signal sent to
  the client's pid reaches the child's whole process group;
- /proc/<pid>/cmdline of a child is the zygote's, sys.flags and
  sys.orig_argv are the zygote's, and a program run by path or -m gains
  runpy's frames in its tracebacks;
- a Jupyter kernel's client dies with the kernel's manager (as ipykernel's
  own watchdog makes a fresh kernel do), so its kernel does too.

DORMOUSE_TEST_WARM=0 turns it off: in the suite's environment, for every
child; in one command's environment, for that command and its children.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import tempfile
from pathlib import Path

REAL = sys.executable
# What every test child imports first (torch.distributed.run itself is left
# out: `-m torch.distributed.run` must find it unimported, as python -m does),
# and DTensor with FSDP2 (~1 CPU-s a process): the ranks of the suite's FSDP2
# and tensor-parallel fleets import them.
PRELOAD = ("torch", "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing", "numpy",
           "safetensors.torch", "torch.distributed.tensor", "torch.distributed.fsdp")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The zygote's own standard streams, kept from being closed (their file
# descriptors are the child's now) until the interpreter's end, after it has
# flushed the child's streams.
_KEEP: list = []
_INSTALLED: dict = {}  # this process's zygote ("zygote": its Popen) and client ("client": its path)
APPLIED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}
# Read at call time, not when torch is imported (torch.cuda._nvml_based_avail reads it in is_available()):
# pytorch_lightning's import sets it in the test process, and every command started after would otherwise
# run cold.
LAZY = {"PYTORCH_NVML_BASED_CUDA_CHECK"}


def _startup_env(env: dict) -> dict:
    """The variables that change how an interpreter (or torch's import) starts."""
    return {k: v for k, v in env.items() if k not in LAZY and (
            (k.startswith("PYTHON") and k not in APPLIED) or k == "OMP_NUM_THREADS"
            or (k.startswith(("TORCH_", "PYTORCH_", "LD_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "GOTO_", "NPY_",
                              "TQDM_")) and not k.startswith("TORCH_NCCL_")))}


def client_source(sock: str, real: str = REAL) -> str:
    """The client: hands its command, environment and streams to the zygote
    at `sock`, forwards signals, and ends as the child ended. Without a
    zygote it executes the real Python."""
    return f"""#!{real} -IS
import os, signal, socket, struct, sys, json
REAL, SOCK, argv = {real!r}, {sock!r}, sys.argv[1:]
def cold():
    os.execv(REAL, [REAL, *argv])
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCK)
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({{"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask}}).encode()
    socket.send_fds(s, [struct.pack("!Q", len(body))], [0, 1, 2])
    s.sendall(body)
except OSError:
    cold()
f = s.makefile("rb")
line = f.readline()
if not line.startswith(b"pid "):
    cold()  # the zygote declined: a command it cannot start as the interpreter would
child = int(line.split()[1])
if os.environ.get("JPY_PARENT_PID") == str(os.getppid()):
    # a Jupyter kernel ends with its manager (ipykernel's watchdog compares its
    # parent with JPY_PARENT_PID; the warm kernel's parent is its supervisor):
    # this client dies with the manager, and its supervisor then kills the kernel
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != int(os.environ["JPY_PARENT_PID"]):
        os._exit(1)
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):  # the child holds the streams now: EOF when IT closes them
    os.dup2(devnull, fd)
def forward(sig, _frame):
    try:
        os.killpg(child, sig)
    except OSError:
        pass
for sig in {[int(s) for s in FORWARDED]!r}:
    signal.signal(sig, forward)
line = f.readline()
if not line.startswith(b"rc "):
    os._exit(1)  # the zygote went away before its child ended
rc = int(line.split()[1])
if rc < 0:  # ended by a signal: so does this client
    if -rc not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(-rc, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-rc])
            os.kill(os.getpid(), -rc)
        except (OSError, ValueError):
            pass
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(rc)
"""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def _parse(argv: list[str]) -> dict | None:
    """python's command line -> what to run, or None (not reproducible here)."""
    opts = {"unbuffered": False}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        a = argv[i]
        if a in ("-m", "-c"):
            if i + 1 >= len(argv):
                return None
            return {**opts, "kind": a[1], "what": argv[i + 1], "args": argv[i + 2:]}
        if a == "-u":  # the one option torchrun gives its ranks; others show in sys.flags: the real Python
            opts["unbuffered"] = True
        else:
            return None
        i += 1
    if i >= len(argv) or argv[i] == "-":
        return None  # the interactive prompt or a program on stdin
    return {**opts, "kind": "script", "what": argv[i], "args": argv[i + 1:]}


def serve(sock: str, client: str) -> dict:
    """The zygote's loop; returns only in a forked child, with the command to run."""
    base_env = dict(os.environ)
    # without the zygote's own entries (the support folder, its -c's '')
    base_path = [p for p in sys.path if p and p != str(Path(__file__).resolve().parent)]
    import gc

    for mod in PRELOAD:
        __import__(mod)
    gc.freeze()  # what the zygote made is never collected in a child (no copy of its pages for the collector)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors reap themselves
    watch = sys.stdin.fileno()  # the worker's pipe: EOF when the worker is gone
    import select
    while True:
        ready, _, _ = select.select([listener, watch], [], [])
        if watch in ready:
            os._exit(0)
        try:
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 8, 3)
            if len(msg) < 8:
                msg += _recv_exact(conn, 8 - len(msg))
            body = json.loads(_recv_exact(conn, struct.unpack("!Q", msg)[0]))
        except (OSError, EOFError, ValueError, struct.error):
            continue
        cmd = _parse(body["argv"]) if body else None
        if (cmd is None or len(fds) != 3 or _startup_env(body["env"]) != _startup_env(base_env)
                or body["env"].get("PYTHONHASHSEED") or body["env"].get("DORMOUSE_TEST_WARM") == "0"):
            try:
                conn.sendall(b"no\n")
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        if os.fork() == 0:  # the supervisor of one child
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return _supervise(conn, fds, body, cmd, base_path, client)
        for fd in fds:
            os.close(fd)
        conn.close()


def _supervise(conn: socket.socket, fds: list[int], body: dict, cmd: dict, base_path: list[str],
               client: str) -> dict:
    os.setsid()  # away from the zygote's group: the worker's signals are not the child's
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        return {**cmd, **body, "base_path": base_path, "client": client}
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    import select
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            rc = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(f"rc {rc}\n".encode())
            except OSError:
                pass
            os._exit(0)
        if not conn.recv(1):  # the client is gone (killed): so is its child's group
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            os.waitpid(pid, 0)
            os._exit(0)


def run_child(job: dict) -> None:
    """In the forked child: become the interpreter the client was asked to
    be, and run its program as __main__ (exits as that program exits)."""
    import importlib.util
    import io
    import runpy
    import logging
    import types

    for sig in range(1, signal.NSIG):  # the dispositions a fresh interpreter starts with
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_IGN if sig in (signal.SIGPIPE, signal.SIGXFSZ) else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    os.umask(job["umask"])
    unbuffered = job["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    old = {name: getattr(sys, name) for name in ("stdin", "stdout", "stderr")}
    _KEEP.extend((*old.values(), sys.__stdin__, sys.__stdout__, sys.__stderr__))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        # as the interpreter's create_stdio: the file's own buffer size, the
        # zygote's encoding and error handlers (the same locale and variables)
        binary = io.open(fd, "rb" if fd == 0 else "wb", buffering=0 if unbuffered and fd else -1, closefd=False)
        raw = binary if isinstance(binary, io.FileIO) else binary.raw
        try:
            raw.name = f"<{name}>"
        except AttributeError:
            pass
        stream = io.TextIOWrapper(binary, encoding=old[name].encoding, errors=old[name].errors,
                                  line_buffering=fd > 0 and not unbuffered and (fd == 2 or raw.isatty()),
                                  write_through=unbuffered and fd > 0)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:  # torch's own handlers
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is old["stderr"]:
                handler.setStream(sys.stderr)
            elif isinstance(handler, logging.StreamHandler) and handler.stream is old["stdout"]:
                handler.setStream(sys.stdout)
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, what = job["kind"], job["what"]
    sys.executable = job["client"]  # its own children start warm too (torchrun's ranks among them)
    sys._base_executable = REAL  # noqa: SLF001
    try:
        if kind == "m":
            sys.path[:] = [os.getcwd(), *extra, *job["base_path"]]
            sys.argv = [what, *job["args"]]
            if importlib.util.find_spec(what) is None:
                _cold(job)  # the interpreter's own "No module named" and status
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif kind == "c":
            sys.path[:] = ["", *extra, *job["base_path"]]
            sys.argv = ["-c", *job["args"]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
        else:
            if not os.path.isfile(what):
                _cold(job)  # the interpreter's own "can't open file" and status
            sys.path[:] = [str(Path(what).resolve().parent), *extra, *job["base_path"]]
            sys.argv = [what, *job["args"]]
            runpy.run_path(os.path.abspath(what), run_name="__main__")
        code = 0
    except SystemExit as e:  # as the interpreter reads it
        code = e.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException as e:  # printed as the interpreter prints it, without this function's frame
        e.__traceback__ = e.__traceback__.tb_next
        sys.excepthook(type(e), e, e.__traceback__)
        if isinstance(e, KeyboardInterrupt):
            _exit(1, by_signal=signal.SIGINT)  # an uncaught Ctrl-C ends the interpreter by the signal
        code = 1
    _exit(code)


def _cold(job: dict) -> None:
    """Become the real interpreter with the same command (environment,
    directory and streams are already the client's)."""
    os.execv(REAL, [REAL, *job["argv"]])


def _exit(code: int, by_signal: int = 0) -> None:
    """The interpreter's exit without its module teardown: a forked child's
    teardown touches every object the zygote made (a copy of each page, ~1 s);
    what a program can see of an exit is kept: non-daemon threads joined,
    atexit functions run (logging's flush, tempfile's clean-up), the standard
    streams flushed, then the status (or the signal of an uncaught Ctrl-C)."""
    import atexit
    import threading

    threading._shutdown()  # noqa: SLF001  what Py_FinalizeEx calls first
    atexit._run_exitfuncs()  # noqa: SLF001
    import gc
    import io

    for obj in gc.get_objects():  # files the program left open (the zygote's are frozen, not listed)
        if isinstance(obj, (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)) and obj not in _KEEP:
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001  a broken or detached stream: nothing more to write
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  as the interpreter: a failed flush of the streams is status 120
            code = code or 120
    if by_signal:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code & 0xFF)


def start(folder: str | None = None) -> str | None:
    """Start this process's zygote; returns the client's path (for
    sys.executable), or None when warm children are off or cannot be had."""
    import subprocess

    if os.environ.get("DORMOUSE_TEST_WARM", "1") == "0" or not hasattr(os, "pidfd_open"):
        return None
    folder = folder or tempfile.mkdtemp(prefix="dormouse-warm-")
    sock = os.path.join(folder, "zygote")
    if len(os.fsencode(sock)) > 100:
        return None
    client = os.path.join(folder, "python")
    Path(client).write_text(client_source(sock))
    os.chmod(client, 0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import warm; "
            f"job = warm.serve({sock!r}, {client!r}); del sys.path[0]; warm.run_child(job)")
    proc = subprocess.Popen([REAL, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=folder)
    _INSTALLED["zygote"] = proc  # its stdin is the pipe it watches: closed when this process ends
    import time
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return client



def install(config) -> None:
    """pytest_configure: in a process that runs tests (an xdist worker, or a
    run without xdist), start the zygote and point sys.executable at its client."""
    if "client" in _INSTALLED or (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")):
        return
    client = start()
    if client:
        _INSTALLED["client"] = client
        sys.executable = client


def uninstall() -> None:
    """pytest_unconfigure: the real interpreter back, and the zygote told to end."""
    client = _INSTALLED.pop("client", None)
    if client:
        sys.executable = REAL
        proc = _INSTALLED.pop("zygote", None)
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=10)
        import shutil

        shutil.rmtree(os.path.dirname(client), ignore_errors=True)  # the client and the socket's folder
