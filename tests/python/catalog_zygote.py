"""A fork server for the Python processes of test_fresh_load.py (its engines, catalog_engine.py, and its
oracles, vllm_check.py and hf_oracle.py) and of test_vllm.py (vllm_check.py): importing torch, transformers and vLLM is most of such a
process's run (~12 s of CPU for vLLM, against ~2.5 s for all the rest of a vLLM oracle), so the
server imports them once and forks every process from there.

    python catalog_zygote.py serve SOCKET       the server: prints "ready" once it serves; runs until
                                                SIGTERM or until its parent exits
    python catalog_zygote.py SCRIPT [ARGS...]   `python SCRIPT ARGS...`, run by the server named by
                                                $WSYNC_CATALOG_ZYGOTE (without it: by this process)

The second form sends the server its arguments, environment, working directory and stdin / stdout /
stderr; the server forks a child that takes them all and runs SCRIPT as `python SCRIPT` would
(run as __main__, its directory first on sys.path), and leaves with its exit status (os._exit: the
interpreter's teardown of vLLM & co takes seconds and checks nothing). This process stands for the
child: it forwards SIGTERM and SIGINT to it and exits with its status; when this process is killed
the server kills the child.

What the children share is imports only: nothing runs in the server before a fork (no torch op: no
OpenMP pool to lose in the child; its only threads are OpenBLAS's, which rebuilds them after a
fork), environment variables are read where the child runs (vLLM's when an engine starts), and no
wsync module is imported in the server: an oracle child runs no wsync code (each oracle checks),
an engine child imports wsync itself, as `python -m wsync` does. (Checked when this was written: the
oracles forked here answered what the same oracles as processes of their own answer, for every
version of every catalog row.)
"""

import gc
import json
import os
import select
import signal
import socket
import sys
import traceback


def run_script(argv):
    """`python argv[0] argv[1:]` in this process: its exit status."""
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        import runpy

        runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def fork(listener, clients, conn):
    """Forks the child `conn` asks for; its pid (-1 for a malformed request)."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(fds) != 3 or not msg:
        for fd in fds:
            os.close(fd)
        return -1
    request = json.loads(msg)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for c in (listener, *clients, conn):
                c.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            status = run_script(request["argv"])
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    for fd in fds:
        os.close(fd)
    return pid


def serve(path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as vllm_check.py and wsync's start_llm set it
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from vllm import LLM  # noqa: F401

    # What is imported stays for the server's life: out of the collector's sight (CPython's advice for
    # a server that forks), a child's gc passes (vLLM runs several as an engine starts, ~0.3 s each
    # over all of the above) scan only what the child made, and do not write to the pages it shares.
    gc.freeze()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    clients = {}  # a client's connection -> its child's pid
    orphans = set()  # children killed since their client went, not yet reaped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener, *clients], [], [], 0.2)
            for conn in readable:
                if conn is listener:
                    client, _ = listener.accept()
                    pid = fork(listener, list(clients), client)
                    if pid < 0:
                        client.close()
                        continue
                    client.send(str(pid).encode())
                    clients[client] = pid
                elif not conn.recv(64):  # its client is gone: so goes the child
                    os.kill(clients[conn], signal.SIGKILL)
                    orphans.add(clients.pop(conn))
                    conn.close()
            while clients or orphans:  # the children that exited: their status to their clients
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                orphans.discard(pid)
                for conn in [c for c, p in clients.items() if p == pid]:
                    code = os.waitstatus_to_exitcode(status)
                    try:
                        conn.send(str(code if code >= 0 else 128 - code).encode())
                    except OSError:
                        pass
                    conn.close()
                    del clients[conn]
    except SystemExit:  # SIGTERM
        pass
    finally:
        for pid in [*clients.values(), *orphans]:
            os.kill(pid, signal.SIGKILL)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the interpreter's teardown of vLLM & co takes seconds


def client(path, argv):
    """Has the server at `path` run `python argv`: the child's exit status."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    socket.send_fds(conn, [json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()],
                    [0, 1, 2])
    pid = int(conn.recv(64))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _: os.kill(pid, s))
    status = conn.recv(64)  # once the child has exited (empty: the server is gone)
    return int(status) if status else 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif os.environ.get("WSYNC_CATALOG_ZYGOTE"):
        sys.exit(client(os.environ["WSYNC_CATALOG_ZYGOTE"], sys.argv[1:]))
    else:
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
