"""Remove what earlier runs left behind when they were killed: `python -m orchestration.cleanup`.

A driver killed with SIGKILL cannot shut its local Ray cluster down (Ray's dashboard and
runtime-env agents keep running) and its trainers cannot unlink their shared-memory weight
files (/dev/shm/rayroles-weights-*). Both carry their owner: a weight file's name holds the
PID and start time of the process that wrote it; a local cluster's session folder is recorded
by `init_cluster` in rayroles-ray-<pid>-<start>.json (in /dev/shm, else the temp folder).
An orphan is one whose owner is gone (no such PID, or the PID now belongs to a process that
started at another time); only orphans are removed: files deleted, and every process with a
file open in an orphaned session folder ended. `init_cluster` runs this before it starts a
local cluster.

    python -m orchestration.cleanup             # remove orphans, print what went
    python -m orchestration.cleanup --dry-run   # only print them
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Optional

# File-name prefix of the trainers' weight files (roles/weight_transfer.SHM_PREFIX; orchestration
# imports no role module): rayroles-weights-<pid>-<start>-<channel>[-<bucket>].
WEIGHT_PREFIX = "rayroles-weights-"
SESSION_PREFIX = "rayroles-ray-"


def default_folders() -> list[str]:
    """Where weight files and session records are written: /dev/shm and the temp folder."""
    return [f for f in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(f)]


def start_ticks(pid: int) -> Optional[int]:
    """When `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22); None where
    unknown. With the PID it names one process: PIDs are reused, start times are not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_alive(pid: int, start: Optional[int]) -> bool:
    """Whether the owner still runs; a start of 0/None (unrecorded) trusts the PID alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = start_ticks(pid)
    return not start or now is None or now == start


# ---- what earlier runs left -----------------------------------------------------------------
def weight_orphans(folders: list[str]) -> list[str]:
    """Weight files and folders whose writer is gone."""
    found = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, WEIGHT_PREFIX + "*"))):
            fields = os.path.basename(path)[len(WEIGHT_PREFIX):].split("-")
            if not fields[0].isdigit():
                continue
            start = int(fields[1]) if len(fields) > 2 and fields[1].isdigit() else None  # older names: PID only
            if not owner_alive(int(fields[0]), start):
                found.append(path)
    return found


def session_orphans(folders: list[str]) -> list[tuple[str, str]]:
    """(record, session folder) of local clusters whose driver is gone."""
    found = []
    for folder in folders:
        for record in sorted(glob.glob(os.path.join(folder, SESSION_PREFIX + "*.json"))):
            owner = read_record(record)
            if owner is not None and not owner_alive(owner["pid"], owner["start"]):
                found.append((record, owner["session_dir"]))
    return found


def read_record(path: str) -> Optional[dict]:
    """A session record, or None if it is not one this module wrote (never acted on)."""
    try:
        rec = json.loads(Path(path).read_text())
        ok = (isinstance(rec.get("pid"), int) and isinstance(rec.get("start"), int) and
              isinstance(rec.get("session_dir"), str) and os.path.isabs(rec["session_dir"]) and
              os.path.basename(rec["session_dir"].rstrip("/")).startswith("session_"))
    except (OSError, ValueError, AttributeError):
        return None
    return rec if ok else None


def session_processes(session_dir: str) -> list[int]:
    """Ray's processes (servers, agents, workers) of this user with a file open in `session_dir`
    (logs, sockets) or naming it on their command line; not a pager reading its logs."""
    inside = os.path.realpath(session_dir).rstrip("/") + "/"
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if not _is_ray(argv):
                continue
            fds = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:  # gone meanwhile, or another user's
            continue
        if any(inside in a for a in argv) or any(fd.startswith(inside) for fd in fds):
            found.append(int(entry))
    return found


def _is_ray(argv: list[str]) -> bool:
    """A Ray worker or agent ("ray::..." titles), a Ray server binary or a script of the ray package."""
    return argv[0].startswith("ray::") or any(
        "/ray/core/src/ray/" in a or ("/ray/" in a and a.endswith(".py")) for a in argv[:3])


# ---- removing them ----------------------------------------------------------------------------
def remove_orphans(folders: Optional[list[str]] = None, dry_run: bool = False) -> list[str]:
    """Remove the orphans in `folders` (default: /dev/shm and the temp folder); returns one
    line per file or process removed (or, with dry_run, that would be)."""
    folders = default_folders() if folders is None else folders
    done = []
    for path in weight_orphans(folders):
        if dry_run or _delete(path):
            done.append(f"weight file {path}")
    for record, session_dir in session_orphans(folders):
        pids = session_processes(session_dir)
        done += [f"process {pid} ({_name(pid)}) of Ray session {session_dir}" for pid in pids]
        if not dry_run:
            _end(pids)
            _delete(record)
    return done


def _delete(path: str) -> bool:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except OSError:  # another user's, or gone meanwhile
        return False


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def end_session(session_dir: str) -> list[int]:
    """End every Ray process of one session (a cluster started by `ray start` included); returns
    their PIDs. Unlike `ray stop`, other clusters on the machine keep running."""
    pids = session_processes(session_dir)
    _end(pids)
    return pids


def _end(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL for what still runs after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(_runs(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if _runs(p)]


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie has ended; only its parent can reap it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ---- recording a local cluster's session ------------------------------------------------------
def session_record_path(folder: Optional[str] = None) -> str:
    """This process's record: its PID and start time name it, so a later driver with the same
    PID writes another one."""
    folder = folder or default_folders()[0]
    return os.path.join(folder, f"{SESSION_PREFIX}{os.getpid()}-{start_ticks(os.getpid()) or 0}.json")


def record_session(session_dir: str, folder: Optional[str] = None) -> str:
    """Record this process as the owner of the Ray session in `session_dir`; the record goes
    when this process exits normally (registered before ray.init, it runs after Ray's shutdown)."""
    path = session_record_path(folder)
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps({"pid": os.getpid(), "start": start_ticks(os.getpid()) or 0,
                                     "session_dir": session_dir}))
    os.replace(tmp, path)
    return path


def forget_session_at_exit(folder: Optional[str] = None) -> None:
    """Delete this process's record at a normal exit. Call it before ray.init: exit handlers run
    last-registered first, so the record outlives Ray's own shutdown."""
    atexit.register(lambda: Path(session_record_path(folder)).unlink(missing_ok=True))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestration.cleanup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="only list the orphans")
    parser.add_argument("--folder", action="append", help="look here instead of /dev/shm and the temp folder "
                                                          "(repeatable)")
    args = parser.parse_args(argv)
    done = remove_orphans(args.folder, dry_run=args.dry_run)
    for line in done:
        print(("would remove " if args.dry_run else "removed ") + line)
    if not done:
        print("nothing left behind by earlier runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
