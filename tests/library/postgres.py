"""A real PostgreSQL server for a test: initdb into a fresh folder, a free port on 127.0.0.1, its unix socket in
that folder; stopped and removed at the end. As root (the test machines) the server runs as the `postgres` user,
which PostgreSQL requires; otherwise as the current user."""

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_dir() -> Path:
    """The server's programs: on PATH, else Debian's /usr/lib/postgresql/<version>/bin (the newest)."""
    found = shutil.which("initdb") or (sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [None])[-1]
    assert found, "PostgreSQL's server (initdb, pg_ctl) is not installed: the tune tests need a real one"
    return Path(found).parent


@contextlib.contextmanager
def server() -> Iterator[str]:
    """A running server; yields its URL (user postgres, no password, database postgres)."""
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    # Not under pytest's tmp_path: its parents are private to root, and the server's user must reach the folder.
    folder = Path(tempfile.mkdtemp(prefix="ddpkit-pg-"))
    data, port = folder / "data", free_port()
    if as_postgres:
        shutil.chown(folder, "postgres")
    run = lambda *cmd: subprocess.run([*as_postgres, *cmd], capture_output=True, text=True, timeout=120, check=True)  # noqa: E731
    try:
        run(str(bin_dir() / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"
        run(str(bin_dir() / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-o", options, "-w", "start")
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            run(str(bin_dir() / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
