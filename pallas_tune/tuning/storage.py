"""Where studies live, and how several workers share one safely.

Every sweep keeps its study in an Optuna RDB storage: PostgreSQL (or MySQL) for many hosts,
SQLite for one host (the embedded default, in the user cache directory). The workers sharing a
study use Optuna's own mechanisms, nothing home-made:

- **Start**: the storage is opened with retries (PostgreSQL's table creation and Optuna's
  version row race when several processes create them at once); the study is created by one
  worker (``load_if_exists=False``: the unique study name decides), the others load it. Only
  the creator enqueues the study's first trials, so the queue holds each of them once.
  On SQLite every transaction begins IMMEDIATE, so that Optuna's claim of a queued trial
  (a read, then a write) is atomic between processes there too.
- **Claims**: a trial popped from the queue is claimed atomically by Optuna
  (``WAITING -> RUNNING`` under a row lock). A config the sampler proposes is a claim once
  its trial is RUNNING with those params; the worker then reads the study, and backs off
  (prunes its trial) when another RUNNING or COMPLETE trial has the same params. Two workers
  that propose a config at the same moment each write before they read, so at least one sees
  the other: a config is never evaluated twice (rarely both back off; it is proposed again).
  Programs (the lowered code several configs may share) are claimed the same way, by
  fingerprint, in :mod:`.programs`.
- **Liveness**: every RUNNING trial of ours gets heartbeats (``storage.record_heartbeat``);
  ``optuna.storages.fail_stale_trials`` fails those of dead workers after the grace period and
  :class:`optuna.storages.RetryFailedTrialCallback` puts their params back in the queue. A
  worker on the same host whose process is gone (kill -9) is failed at once: each trial
  records its owner (host, pid and the run in that process). So is a trial of a finished run
  of this very process that could not give its trials back (the disk was full, the database
  gone): a tune resumed in the same process (a notebook) takes them at once, not after the
  grace period.
"""

from __future__ import annotations

import datetime
import os
import socket
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Final

from pallas_tune.errors import TuneOptionError

__all__ = ["HEARTBEAT_S", "Heartbeat", "check_url", "default_storage_url", "fail_dead",
           "close_run", "load_or_create", "open_run", "open_storage", "owner", "storage_dir"]

HEARTBEAT_S: Final = 10  # Seconds between heartbeats of a running trial.
GRACE_S: Final = 60  # A trial without a heartbeat for this long belongs to a dead worker.
UNCLAIMED_S: Final = 20  # A RUNNING trial with no owner this old was never claimed.
OWNER_ATTR: Final = "pallas_tune:owner"
_RETRIES: Final = 8


# SQLAlchemy's database dialects (``postgresql+psycopg://`` names a driver too).
SCHEMES: Final = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")
_SQLITE_MAGIC: Final = b"SQLite format 3\x00"


def storage_dir() -> str:
    """Where the embedded default storage lives: ``<user cache>/.studies``
    (``$PALLAS_TUNE_STORAGE_DIR`` overrides it). Not created here."""
    base = os.environ.get("PALLAS_TUNE_STORAGE_DIR")
    if not base:
        from pallas_tune import _settings

        base = os.path.join(_settings.cache_dir(), ".studies")
    return os.path.abspath(base)


def default_storage_url(*, create: bool = True) -> str:
    """The embedded default: ``<user cache>/.studies/studies.db``, one SQLite file beside the
    tuned configs (``$PALLAS_TUNE_STORAGE_DIR`` overrides the directory, created unless
    ``create`` is False)."""
    base = storage_dir()
    if create:
        os.makedirs(base, exist_ok=True)
    return "sqlite:///" + os.path.join(base, "studies.db")


def check_url(url: str, *, files: bool = False) -> None:
    """Raises TuneOptionError unless ``url`` is a storage URL of a known database; with
    ``files``, also unless an SQLite URL's directory exists and its file, if there is one, is
    an SQLite database. Opens nothing for writing, creates nothing."""
    scheme, sep, rest = url.partition("://")
    dialect = scheme.partition("+")[0].lower()
    if not sep or not scheme:
        raise TuneOptionError(f"storage={url!r} is not a storage URL; give one such as "
                              "'sqlite:///tune.db' or 'postgresql://user@host/db'.")
    if dialect not in SCHEMES:
        raise TuneOptionError(f"storage={url!r}: unknown scheme {scheme!r}; the databases are "
                              f"{list(SCHEMES)} (e.g. 'sqlite:///tune.db', "
                              "'postgresql://user@host/db').")
    if files and dialect == "sqlite":
        _check_sqlite_file(url, rest.partition("?")[0])


def _check_sqlite_file(url: str, rest: str) -> None:
    path = rest[1:] if rest.startswith("/") else rest  # sqlite:///rel.db, sqlite:////abs.db
    if path in ("", ":memory:"):
        return
    if "\x00" in path:
        raise TuneOptionError(f"storage={url!r}: {path!r} is not a file name.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise TuneOptionError(f"storage={url!r}: no such directory {parent}; create it, or "
                              "give a path in an existing directory.")
    if not os.path.lexists(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            head = os.read(fd, len(_SQLITE_MAGIC)) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
    except OSError as e:
        raise TuneOptionError(f"storage={url!r}: cannot read {path} ({e.strerror or e})"
                              ) from None
    if not stat.S_ISREG(st.st_mode):
        raise TuneOptionError(f"storage={url!r}: {path} is not a regular file; give the path "
                              "of an SQLite database, or of a new file to create.")
    if st.st_size and head != _SQLITE_MAGIC:
        raise TuneOptionError(f"storage={url!r}: {path} is not an SQLite database (it holds "
                              "something else, left as it is); give a new file name.")


def open_storage(storage: Any) -> Any:
    """An Optuna storage for a URL (with heartbeats and retried stale trials), or ``storage``
    itself when it already is one. Retries the races of several processes creating tables."""
    if not isinstance(storage, str):
        return storage
    import optuna
    import sqlalchemy.exc

    kwargs: dict[str, Any] = {}
    if storage.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": 120}}  # Wait for the file lock, never fail.
    else:
        kwargs = {"pool_pre_ping": True}
    last: Exception | None = None
    for attempt in range(_RETRIES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                opened = optuna.storages.RDBStorage(
                    storage, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_S,
                    grace_period=GRACE_S, **{_callback_kw(): _retry()})
            if storage.startswith("sqlite"):
                _immediate_transactions(opened.engine)
            return opened
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError,
                sqlalchemy.exc.OperationalError) as e:
            last = e  # Another worker is creating the same tables: wait, try again.
            time.sleep(0.2 * (attempt + 1))
        except sqlalchemy.exc.DatabaseError as e:  # Not a database (after check_url said so).
            raise TuneOptionError(f"storage={storage!r} cannot be opened ({e.orig}); give "
                                  "the URL of a database, or a new SQLite file.") from None
        except ImportError as e:
            raise TuneOptionError(f"storage={storage!r} needs a database driver that is not "
                                  f"installed ({e}); for PostgreSQL: pip install "
                                  "'pallas-tune[postgres]' (psycopg).") from None
        except (ValueError, sqlalchemy.exc.ArgumentError) as e:
            raise TuneOptionError(f"storage={storage!r} cannot be opened ({e}); give an Optuna "
                                  "storage URL such as 'sqlite:///tune.db' or "
                                  "'postgresql://user@host/db'.") from None
    why = " ".join(str(getattr(last, "orig", None) or last).split())  # One line, no tabs.
    raise TuneOptionError(f"storage={storage!r} could not be opened after {_RETRIES} tries: "
                          f"{why}; check that the database server is up and reachable.")


def _immediate_transactions(engine: Any) -> None:
    """Every SQLite transaction begins IMMEDIATE (holding the write lock from its first read).
    Python's sqlite3 begins a transaction only at the first write, so Optuna's read-then-write
    claim of a queued trial (WAITING -> RUNNING) let two processes both read WAITING and both
    claim it. SQLAlchemy's recipe for SQLite transactions; pooled connections are reopened."""
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # sqlite3 issues no BEGIN of its own.

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()


def load_or_create(storage: Any, name: str, *, sampler: Any) -> tuple[Any, bool]:
    """The study ``name`` in ``storage`` and whether this call created it (then this worker
    alone sets it up). Safe when many workers call it at the same moment."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(_RETRIES):
        try:
            return optuna.create_study(direction="minimize", sampler=sampler, storage=storage,
                                       study_name=name, load_if_exists=False), True
        except optuna.exceptions.DuplicatedStudyError:
            pass
        except sqlalchemy.exc.IntegrityError:
            pass  # Lost the race for the name inside the storage: the study exists.
        try:
            return optuna.load_study(study_name=name, storage=storage, sampler=sampler), False
        except KeyError:
            time.sleep(0.1 * (attempt + 1))  # Created and not yet visible: look again.
    raise TuneOptionError(f"study {name!r} could neither be created nor loaded in {storage!r}")


# Optuna >= 4.9 names the stale-trial callback differently (the old name still works there).
def _callback_kw() -> str:
    import inspect

    import optuna

    params = inspect.signature(optuna.storages.RDBStorage).parameters
    return ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params
            else "failed_trial_callback")


def _retry() -> Any:
    """Optuna's callback that puts a dead worker's trial back in the queue."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
        return (cls or optuna.storages.RetryFailedTrialCallback)()


_OPEN_RUNS: set[str] = set()  # This process's runs that may still hold RUNNING trials.


def open_run() -> str:
    """A token for a run (a :class:`~pallas_tune.tuning.study.Search`) of this process, live
    until :func:`close_run`; its trials' owner tag names it."""
    token = os.urandom(6).hex()
    _OPEN_RUNS.add(token)
    return token


def close_run(token: str | None) -> None:
    _OPEN_RUNS.discard(token)


def owner(run: str | None = None) -> str:
    """Who runs a trial: ``host:pid``, and ``:run`` where given."""
    tag = f"{socket.gethostname()}:{os.getpid()}"
    return f"{tag}:{run}" if run else tag


def _alive_here(tag: Any) -> bool:
    """False only for a trial of this host whose process is gone, or of a closed run of this
    process (``host:pid:run``)."""
    if not isinstance(tag, str) or ":" not in tag:
        return True
    parts = tag.split(":")
    host, pid = parts[0], parts[1]
    if host != socket.gethostname() or not pid.isdigit():
        return True
    if int(pid) == os.getpid():
        return len(parts) < 3 or parts[2] in _OPEN_RUNS
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_dead(study: Any) -> int:
    """Fails the RUNNING trials of dead workers (and requeues their params): this host's at
    once, other hosts' after the heartbeat grace period. Returns how many this call failed."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage
    failed = 0
    now = datetime.datetime.now()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        tag = t.system_attrs.get(OWNER_ATTR)
        if tag is None:  # Killed between its creation and its claim (milliseconds apart).
            started = t.datetime_start
            if started is None or (now - started).total_seconds() < UNCLAIMED_S:
                continue
        elif _alive_here(tag):
            continue
        try:
            if storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                failed += 1
                _retry()(study, storage.get_trial(t._trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # Another worker failed it first.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    return failed


class Heartbeat:
    """One thread that records a heartbeat for each trial id in ``ids()`` every
    ``HEARTBEAT_S`` seconds, when the storage has heartbeats."""

    def __init__(self, storage: Any, ids: Callable[[], Iterable[int]]):
        from optuna.storages._heartbeat import is_heartbeat_enabled

        self._storage = storage
        self._ids = ids
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if is_heartbeat_enabled(storage):
            self._thread = threading.Thread(target=self._beat, name="pallas-tune-heartbeat",
                                            daemon=True)
            self._thread.start()

    def beat(self, trial_id: int) -> None:
        if self._thread is not None:
            self._storage.record_heartbeat(trial_id)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for trial_id in list(self._ids()):
                try:
                    self._storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001  A lost connection: the next beat retries.
                    pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S)
