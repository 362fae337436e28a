"""Counters of every copy of one pipe or node, across the processes of a job.

A DataLoader copies the dataset into each worker process; the counters users want most
(the hit rate) are then spread over processes the training loop never sees. Each copy
outside the process that built the pipe writes its counters, at most about once a
second and once more when it exits, to a small file of its own in a directory named
after the pipe; the building process sums them in ``stats()``.

Why files in shared memory (``/dev/shm`` when writable, else the temp dir) and not the
store or a pipe: they work when the store is down (when the error counters matter
most), survive the worker that wrote them (the final numbers of a non-persistent
worker are still there after it exited), need no message loop in the parent, and cost
one small atomic write per second per worker. They are local to the machine, as a
DataLoader's workers are. The directory is removed when the building process lets go
of the pipe (or exits); directories of crashed jobs older than a day are swept.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["META_FILE", "REPORT_INTERVAL", "StatsBoard"]

#: Seconds between two reports of one process (the "at most about a second old").
REPORT_INTERVAL = 1.0
_STALE_AFTER = 24 * 3600
#: The board's label (namespace, owner pid); not ``*.json``, so collect() never reads it.
META_FILE = "board.meta"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that pid: not ours, but alive
        return True
    return True


def _base_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


class StatsBoard:
    """Where the copies of one pipe or node publish their counters."""

    def __init__(self, board_id: str) -> None:
        self.board_id = board_id
        self.root = _base_dir() / f"asynccache-stats-{os.getuid()}"
        self.directory = self.root / board_id

    def publish(self, counters: dict[str, int]) -> None:
        """Write this process's counters (atomically: readers never see half a file)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{os.getpid()}.json"
        partial = self.directory / f".{os.getpid()}.tmp"
        partial.write_text(json.dumps(counters))
        os.replace(partial, final)

    def collect(self) -> dict[int, dict[str, int]]:
        """The latest counters of every other process that published, by pid."""
        found: dict[int, dict[str, int]] = {}
        own = os.getpid()
        with contextlib.suppress(FileNotFoundError):
            for path in self.directory.glob("*.json"):
                try:
                    pid = int(path.stem)
                    counters = json.loads(path.read_text())
                except (ValueError, OSError):
                    continue  # a file being replaced, or not ours: the next read gets it
                if pid != own and isinstance(counters, dict):
                    found[pid] = {k: int(v) for k, v in counters.items()}
        return found

    # -- for a process outside the job (``asynccache stats``) -------------------------------
    def label(self, namespace: str | None) -> None:
        """Record which namespace the board counts for and which process owns it, so a
        process that did not build the pipe can find the boards of a namespace."""
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".{os.getpid()}.meta.tmp"
        partial.write_text(json.dumps({"namespace": namespace, "owner": os.getpid()}))
        os.replace(partial, self.directory / META_FILE)

    def metadata(self) -> dict[str, Any] | None:
        """What :meth:`label` recorded, or None (an unlabelled or vanished board)."""
        try:
            found = json.loads((self.directory / META_FILE).read_text())
        except (OSError, ValueError):
            return None
        return found if isinstance(found, dict) else None

    @classmethod
    def labelled(cls, namespace: str) -> list[StatsBoard]:
        """This user's boards on this machine labelled with ``namespace`` whose owner
        process is still running (a crashed job's board is not current)."""
        root = cls("-").root
        boards = []
        with contextlib.suppress(FileNotFoundError):
            for directory in sorted(root.iterdir()):
                board = cls(directory.name)
                meta = board.metadata()
                if meta is not None and meta.get("namespace") == namespace \
                        and _alive(meta.get("owner")):
                    boards.append(board)
        return boards

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def sweep(self) -> None:
        """Remove boards left behind by jobs that did not exit cleanly (over a day old)."""
        now = time.time()
        with contextlib.suppress(FileNotFoundError):
            for board in self.root.iterdir():
                with contextlib.suppress(OSError):
                    if board != self.directory and now - board.stat().st_mtime > _STALE_AFTER:
                        shutil.rmtree(board, ignore_errors=True)

    # -- latency histograms and job-wide "log once" (asynccache.metrics) ----------------
    # Kept in subdirectories, so ``collect`` (``*.json`` at the top) never sees them.

    def publish_latency(self, rows: dict[str, list[int]]) -> None:
        """Write this process's latency histograms (``Latency.to_row()`` per kind)."""
        directory = self.directory / "latency"
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{os.getpid()}.tmp"
        partial.write_text(json.dumps(rows))
        os.replace(partial, directory / f"{os.getpid()}.json")

    def collect_latency(self) -> dict[int, dict[str, list[int]]]:
        """The latest histograms of every other process that published, by pid."""
        found: dict[int, dict[str, list[int]]] = {}
        own = os.getpid()
        with contextlib.suppress(FileNotFoundError):
            for path in (self.directory / "latency").glob("*.json"):
                try:
                    pid = int(path.stem)
                    rows = json.loads(path.read_text())
                except (ValueError, OSError):
                    continue
                if pid != own and isinstance(rows, dict):
                    found[pid] = {str(k): [int(v) for v in row] for k, row in rows.items()
                                  if isinstance(row, list)}
        return found

    def claim(self, kind: str) -> bool:
        """True for the first process of the job to claim ``kind`` (a failure to log).

        A marker file created with ``O_EXCL``: exactly one process wins, however many
        DataLoader workers (or epochs of fresh workers) hit the same failure. When the
        board cannot be written the answer is True: logging twice beats logging never.
        """
        directory = self.directory / "logged"
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in kind)[:200]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        except OSError:
            return True
        os.close(fd)
        return True
