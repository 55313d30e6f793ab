"""A stand-in ``nvidia-cuda-mps-control`` whose MPS server can fault, for the fault-domain tests.

test_mps_manager.py's stand-in answers the commands MpsManager sends, with servers and
clients fixed by the environment. This one also models what NVIDIA documents for a fault
(workers.gpu.mps_recovery): the daemon spawns a real server process (its command line names
``nvidia-cuda-mps``, as the real ``nvidia-cuda-mps-server``'s does) for the first client;
clients are real processes (the tests' stand-ins for CUDA programs), gone from the lists
once they exit. After ``fake_fault`` the server refuses new clients with 807 until every
client it had is gone (exited, or detached by ``terminate_client``), then serves again.
``quit`` waits for attached clients, as the real one waits for its servers' clients.

Test-only commands, sent through the control socket like the real ones:
``fake_client_connect <pid>`` (a CUDA program's first call: "connected <server>", or the
807 refusal) and ``fake_fault`` (a client's kernel faulted). Environment, read as the
daemon starts: ``FAKE_MPS_STUBBORN`` (terminate_client detaches no one) and
``FAKE_MPS_FAIL`` (``-d`` fails, as test_mps_manager.py's).
"""

from __future__ import annotations

import sys
from pathlib import Path

REFUSED = "cudaErrorMpsServerNotReady (807): MPS Server Not Accepting New Client Requests"

FAULTABLE_CONTROL = r"""
import os, signal, socket, subprocess, sys, time

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
logdir = os.environ["CUDA_MPS_LOG_DIRECTORY"]
sock_path = os.path.join(pipe, "control")
pid_path = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
REFUSED = "cudaErrorMpsServerNotReady (807): MPS Server Not Accepting New Client Requests"


def record(line):
    with open(os.path.join(logdir, "control.log"), "a") as f:
        f.write(line + "\n")


def alive(pid):
    try:
        os.kill(pid, 0)
        stat = open("/proc/%d/stat" % pid).read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class Server:
    def __init__(self):
        self.process = subprocess.Popen([sys.executable, __file__, "--mps-server"], start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.pid = self.process.pid
        self.clients = []
        self.faulted = False


def daemon():
    stubborn = bool(os.environ.get("FAKE_MPS_STUBBORN"))
    defaults = {"thread": "100", "mem": {}}
    servers = {}  # pid -> Server
    quitting = False
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen(8)
    listener.settimeout(0.05)
    record("START")
    with open(pid_path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pid_path + ".tmp", pid_path)

    def tidy():
        for pid, server in list(servers.items()):
            if server.process.poll() is not None:
                record("SERVER GONE %d" % pid)
                del servers[pid]
                continue
            server.clients = [c for c in server.clients if alive(c)]
            if server.faulted and not server.clients:
                server.faulted = False
                record("RECOVERED %d" % pid)

    def answer(words):
        if words[0] == "fake_client_connect":
            if quitting:
                return ["Cannot connect: the MPS control daemon is shutting down"]
            live = [s for s in servers.values()]
            server = live[0] if live else None
            if server is None:
                server = Server()
                servers[server.pid] = server
            if server.faulted:
                return [REFUSED]
            server.clients.append(int(words[1]))
            return ["connected %d" % server.pid]
        if words == ["fake_fault"]:
            for server in servers.values():
                if server.clients:
                    server.faulted = True
                    return ["faulted %d" % server.pid]
            return ["no client to fault"]
        if words == ["get_server_list"]:
            return [str(p) for p in servers]
        if words[0] == "get_client_list" and len(words) == 2:
            server = servers.get(int(words[1])) if words[1].isdigit() else None
            return [str(c) for c in server.clients] if server else ["Server %s not found" % words[1]]
        if words[0] == "terminate_client" and len(words) == 3:
            server = servers.get(int(words[1])) if words[1].isdigit() else None
            if server is None:
                return ["Server %s not found" % words[1]]
            if not stubborn and int(words[2]) in server.clients:
                server.clients.remove(int(words[2]))
            return []
        if words[0] == "set_default_active_thread_percentage" and len(words) == 2:
            defaults["thread"] = words[1]
            return []
        if words[0] in ("set_default_device_pinned_mem_limit", "set_active_thread_percentage",
                        "set_device_pinned_mem_limit"):
            return []
        return ["Unrecognized command: " + " ".join(words)]

    while True:
        tidy()
        if quitting and not any(s.clients for s in servers.values()):
            for server in servers.values():
                server.process.kill()
                server.process.wait()
            os.unlink(sock_path)
            os.unlink(pid_path)
            record("EXIT")
            return
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        data = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        out = []
        for line in data.decode().splitlines():
            words = line.split()
            if not words:
                continue
            record("Cmd:" + line.strip())
            tidy()
            if words == ["quit"]:
                quitting = True
            else:
                out.extend(answer(words))
        conn.sendall(("\n".join(out) + ("\n" if out else "")).encode())
        conn.close()


if sys.argv[1:] == ["-d"]:
    if os.path.exists(pid_path):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    if os.environ.get("FAKE_MPS_FAIL"):
        print("Failed to start MPS control daemon: " + os.environ["FAKE_MPS_FAIL"], file=sys.stderr)
        sys.exit(1)
    subprocess.Popen([sys.executable, __file__, "--serve"], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.exit(0)
elif sys.argv[1:] == ["--serve"]:
    daemon()
elif sys.argv[1:] == ["--mps-server"]:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(60)
elif not sys.argv[1:]:
    client = socket.socket(socket.AF_UNIX)
    try:
        client.connect(sock_path)
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    client.sendall(sys.stdin.read().encode())
    client.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        chunk = client.recv(4096)
        if not chunk:
            break
        reply += chunk
    sys.stdout.write(reply.decode())
else:
    print("usage: nvidia-cuda-mps-control [-d | -f]", file=sys.stderr)
    sys.exit(2)
"""


def install(directory: Path) -> Path:
    """Write the stand-in as ``<directory>/bin/nvidia-cuda-mps-control``; its path."""
    binary = directory / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text(f"#!{sys.executable}\n{FAULTABLE_CONTROL}")
    binary.chmod(0o755)
    return binary
