"""A checkpoint that is resumed from is a complete one: the tracker, restarts and preemption.

megatron.training saves a torch_dist checkpoint in this order: every rank writes its shards, DCP's
coordinator writes ``.metadata``, rank 0 writes ``metadata.json``, all ranks meet at a barrier, and only
then rank 0 rewrites ``latest_checkpointed_iteration.txt``. So a process killed during a save leaves an
iteration directory without those last files while the tracker still names the previous checkpoint.
Two gaps remain, closed here:

- the tracker is rewritten in place (``open(..., 'w')``): a kill inside that write leaves it empty, and
  megatron's ``read_metadata`` then ends the run with exit code 0 and nothing loaded. It is written
  through a temporary file and ``os.replace`` instead (``_AtomicTrackerFile``);
- the next start says nothing about the directory it ignores, and an empty or corrupt tracker (or one
  naming an incomplete directory) is not recovered. ``read_metadata`` is wrapped: it names every
  incomplete directory it skips, why, and the checkpoint resumed from, falling back to the newest
  complete one when the tracker cannot be used.

Restart: torchrun's static rendezvous (``--master-port``) keeps one agent store for every attempt of the
job, and the workers of a restarted attempt join it under the same keys: gloo reads the killed attempt's
addresses and fails to connect. The process group of attempt N is built on that store under an
attempt-N prefix.

Preemption: megatron's ``--exit-signal-handler`` all-gathers each rank's SIGTERM flag on a tensor whose
device comes from the backend name, known only for nccl and gloo; any other backend (hccl on NPU) raises.
The device then comes from the platform layer.
"""

from __future__ import annotations

import os
import re
import tempfile

from hyper_adaptor.patch_manager import Patch

FEATURE = "checkpoint"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
# The files a save writes last, per --ckpt-format: torch_dist's DCP coordinator writes .metadata after
# every shard and megatron's metadata.json comes after it; torch_dcp and fsdp_dtensor are DCP alone; the
# legacy torch format leaves no such mark
FINAL_FILES = {"torch_dist": (".metadata", "metadata.json"), "torch_dcp": (".metadata",),
               "fsdp_dtensor": (".metadata",)}


def patches(args) -> list:
    found = [
        Patch("megatron.training.checkpointing.maybe_msc", _atomic_tracker, kind="wrap", feature=FEATURE,
              rebind_in=()),
        Patch("megatron.training.initialize._initialize_distributed", _store_per_attempt, kind="wrap",
              feature=FEATURE),
    ]
    # --ckpt-step names the iteration itself: the tracker is not what is resumed from
    if not getattr(args, "ckpt_step", None):
        found.append(Patch("megatron.training.checkpointing.read_metadata",
                           _complete_checkpoint_reader(final_files(args)), kind="wrap", feature=FEATURE))
    if getattr(args, "exit_signal_handler", False):
        found.append(Patch("megatron.training.dist_signal_handler.get_device", _platform_signal_device,
                           kind="wrap", feature=FEATURE))
    return found


# --- what is complete -------------------------------------------------------------------------------

def final_files(args) -> tuple[str, ...]:
    return FINAL_FILES.get(getattr(args, "ckpt_format", None) or "torch_dist", ())


def problems(args) -> list[str]:
    """Why a --load cannot start: its tracker exists while no checkpoint beside it is complete."""
    load = getattr(args, "load", None)
    if not load or not os.path.isfile(os.path.join(load, TRACKER)) or getattr(args, "ckpt_step", None):
        return []
    chosen, said = choose(load, final_files(args))
    if chosen is None and said:
        return [f"--load {load}: no complete checkpoint to resume from: {'; '.join(said)}"]
    return []


def iteration_dirs(save_dir) -> dict[int, str]:
    """{iteration: path} of the ``iter_NNNNNNN`` directories under ``save_dir``."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return {}
    found = {}
    for name in names:
        match = _ITER_DIR.match(name)
        path = os.path.join(save_dir, name)
        if match and os.path.isdir(path):
            found[int(match.group(1))] = path
    return found


def incomplete_reason(path, final=FINAL_FILES["torch_dist"]) -> str | None:
    """Why the checkpoint directory ``path`` is not complete, or None when it is (or when its format
    leaves no mark of completion: legacy ``torch`` checkpoints are taken as they are)."""
    try:
        names = set(os.listdir(path))
    except OSError as error:
        return f"it cannot be read ({error.strerror})"
    if not names:
        return "it is empty"
    if any(n.startswith("mp_rank_") for n in names):
        return None
    missing = [n for n in final if n not in names]
    if missing:
        return f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing (the save did not finish)"
    return None


def parse_tracker(path) -> tuple[int | None, str | None]:
    """(iteration, None) from a tracker file, (0, None) for megatron's 'release', or (None, why)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as error:
        return None, f"it cannot be read ({error.strerror})"
    if text == "release":
        return 0, None
    if not text:
        return None, "it is empty"
    try:
        value = int(text)
    except ValueError:
        return None, f"it holds {text[:40]!r}, not an iteration"
    return (value, None) if value >= 0 else (None, f"it holds {value}")


def choose(save_dir, final=FINAL_FILES["torch_dist"]) -> tuple[int | None, list[str]]:
    """The iteration to resume from under ``save_dir`` and the sentences explaining what was skipped.

    The tracker's iteration when its directory is complete, else the newest complete directory
    older than it (or, with an unusable tracker, the newest complete one); None with no complete
    checkpoint. Incomplete directories newer than the choice are reported too. Release checkpoints
    (tracker 'release') are left to megatron: (None, [])."""
    tracker = os.path.join(save_dir, TRACKER)
    named, why_not = parse_tracker(tracker)
    dirs = iteration_dirs(save_dir)
    if named == 0 and why_not is None and 0 not in dirs:
        return None, []
    said = []
    if why_not is not None:
        said.append(f"the tracker {tracker} is not usable: {why_not}")
    candidates = sorted((i for i in dirs if why_not is not None or i <= named), reverse=True)
    chosen = None
    for iteration in candidates:
        reason = incomplete_reason(dirs[iteration], final)
        if reason is None:
            chosen = iteration
            break
        said.append(f"skipped {dirs[iteration]}: {reason}")
    if named is not None and named not in dirs:
        said.insert(0, f"the tracker names iteration {named}, whose directory does not exist")
    for iteration in sorted((i for i in dirs if chosen is None or i > chosen), reverse=True):
        if iteration in candidates:
            continue
        reason = incomplete_reason(dirs[iteration], final)
        if reason is not None:
            said.append(f"skipped {dirs[iteration]}: {reason}")
    return chosen, said


# --- the seams --------------------------------------------------------------------------------------

def _complete_checkpoint_reader(final):
    return lambda read_metadata: _reader(read_metadata, final)


def _reader(read_metadata, final):
    def read_complete_metadata(tracker_filename):
        from hyper_adaptor.notice import notice

        save_dir = os.path.dirname(os.path.abspath(tracker_filename))
        if os.path.basename(tracker_filename) != TRACKER:
            return read_metadata(tracker_filename)
        named, why_not = parse_tracker(tracker_filename)
        chosen, said = choose(save_dir, final)
        if not said:
            return read_metadata(tracker_filename)
        if chosen is None:
            raise RuntimeError(f"--load {save_dir}: no complete checkpoint to resume from; " + "; ".join(said))
        notice(f"checkpoint: {'; '.join(said)}; resuming from iteration {chosen} "
               f"({iteration_dirs(save_dir)[chosen]})")
        if why_not is None and chosen == named:
            return read_metadata(tracker_filename)
        # megatron's reader also agrees on the iteration across ranks; it reads a tracker naming the choice
        with tempfile.TemporaryDirectory(prefix="hyper_adaptor_tracker_") as tmp:
            stand_in = os.path.join(tmp, TRACKER)
            with open(stand_in, "w") as f:
                f.write(str(chosen))
            return read_metadata(stand_in)

    return read_complete_metadata


class _AtomicTrackerFile:
    """A file opened for writing the tracker: the text lands under the tracker's name only on close."""

    def __init__(self, path, mode):
        self._path = path
        fd, self._tmp = tempfile.mkstemp(prefix=f".{TRACKER}.", dir=os.path.dirname(path) or ".")
        # mkstemp's 0600 would make the tracker unreadable to the group that reads the checkpoints
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        self._file = os.fdopen(fd, mode)

    def write(self, text):
        return self._file.write(text)

    def close(self):
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self._path)

    def abandon(self):
        self._file.close()
        try:
            os.unlink(self._tmp)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
        else:
            self.abandon()
        return False


def _atomic_tracker(maybe_msc):
    """megatron.training.checkpointing's ``maybe_msc`` as it was, except that opening the tracker for
    writing on a local path goes through ``_AtomicTrackerFile``."""

    class AtomicTrackerStorage:
        def __getattr__(self, name):
            return getattr(maybe_msc, name)

        def open(self, path, mode="r", *rest, **kwargs):
            local = isinstance(path, (str, os.PathLike)) and "://" not in str(path)
            if local and os.path.basename(path) == TRACKER and mode in ("w", "wt") and not rest and not kwargs:
                return _AtomicTrackerFile(os.fspath(path), mode)
            return maybe_msc.open(path, mode, *rest, **kwargs)

    return AtomicTrackerStorage()


def attempt_store():
    """The agent's store under this attempt's prefix, or None when the default (env://) store is right:
    not under torchrun's agent store, or its first attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    import torch.distributed as dist

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=False, timeout=datetime.timedelta(minutes=10))
    return dist.PrefixStore(f"/hyper_adaptor/attempt_{attempt}", base)


def _store_per_attempt(initialize_distributed):
    import inspect

    position = list(inspect.signature(initialize_distributed).parameters).index("store")

    def initialize(*args, **kwargs):
        given = args[position] if len(args) > position else kwargs.get("store")
        if given is None:
            store = attempt_store()
            if store is not None:
                if len(args) > position:
                    args = args[:position] + (store,) + args[position + 1:]
                else:
                    kwargs["store"] = store
        return initialize_distributed(*args, **kwargs)

    return initialize


def _platform_signal_device(get_device):
    def signal_device(local_rank=None):
        import torch

        if torch.distributed.get_backend() in ("nccl", "gloo"):
            return get_device(local_rank)
        from hyper_adaptor import platform

        return platform.current_device()

    return signal_device
