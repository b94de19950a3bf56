"""`shm`: each bucket is a file in the servers' shared staging directory; the servers adopt it by hard link.

`ShmTransport` is the transport; `ShmStager` owns the files: written atomically, rewritten in place from sync
to sync, and (a learner on CPU) the home of the learner's own parameters between syncs.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from learner.weights.sync_stream import BucketParts, is_loopback_url
from learner.weights.transports.base import PartsTransport, TransportOptions, register
from learner.weights.types import SyncError
from shared_schemas.sync import BucketSpec, SyncManifest

if TYPE_CHECKING:
    from learner.weights.session import SyncSession
    from learner.weights.types import WeightUpdate

__all__ = ["ShmStager", "ShmTransport"]

logger = logging.getLogger(__name__)


@register("shm")
class ShmTransport(PartsTransport):
    """Bucket files in `rollout.sync.shm_dir` (= the servers' `server.shm_dir`); every server on this host.

    Bucket k's file is rewritten in place by the next sync once no server holds it, and after a committed
    sync the learner's CPU parameters move into the files when the update offers them
    (`rollout.sync.shm_share_parameters`; `ShmStager.share`).

    Raises:
        ValueError: no `shm_dir`, or a server that is not on a loopback address.
    """

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        if options.shm_dir is None:
            raise ValueError(
                "rollout.sync.transport 'shm' needs rollout.sync.shm_dir, the servers' server.shm_dir"
                " (/health does not expose it)"
            )
        remote = [url for url in options.urls if not is_loopback_url(url)]
        if remote:
            raise ValueError(
                f"rollout.sync.transport 'shm' needs every server on this host, but {remote[0]} is not a"
                " loopback address; use transport 'http'"
            )
        self.stager = ShmStager(options.shm_dir)
        self._reused_before = 0
        self._shared_before = 0

    def joined(self, sessions: Sequence[SyncSession]) -> None:
        self._reused_before = self.stager.reused_bytes
        self._shared_before = self.stager.shared_bytes

    def sent_stages(self) -> dict[str, float]:
        """`shm_reused_bytes`: bytes of the files an earlier sync left that this sync reused (no new tmpfs
        pages); `shm_shared_bytes`: of them, tensor bytes not written at all (the learner's parameters live
        in the files)."""
        return {
            "shm_reused_bytes": float(self.stager.reused_bytes - self._reused_before),
            "shm_shared_bytes": float(self.stager.shared_bytes - self._shared_before),
        }

    def committed(self, update: WeightUpdate) -> None:
        if update.parameters:
            self.stager.share(update.parameters)

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        with self.stager.staged(manifest.version, bucket.index, parts) as file_name:
            list(self.options.pool.map(lambda s: s.upload_shm(bucket.index, file_name), sessions))

    def failed(self, urls: Sequence[str]) -> None:
        # A server may still hold (and read) a file: the learner's parameters leave the files, and the next
        # sync writes new ones.
        self.stager.discard()

    def close(self) -> None:
        self.stager.close()


class ShmStager:
    """Writes bucket files into the servers' shared staging directory, and reuses them from sync to sync.

    The directory must be the one the servers are configured with (`server.shm_dir`); `/health` does not
    expose it, so the learner takes it from `rollout.sync.shm_dir`. Files appear atomically (written under
    a hidden temporary name, then renamed), so a server never maps a half-written bucket.

    Reuse, why and when: a bucket written into a NEW tmpfs file pays for page allocation and zeroing
    (2.8 GB/s measured on the 2-core CI host, against 6.2 GB/s for a copy into pages that already exist), so
    after a bucket has been taken over the stager keeps its file under a hidden spare name and the next sync
    rewrites bucket k's file in place. A server takes a file over with a hard link of its own and drops that
    link when its sync ends (committed, rejected, aborted or expired: `rollout_server.weights.staging`), after
    its engine has loaded the bytes. So a spare is rewritten only while its link count is 1 (no server holds
    it any more); otherwise it is left to the server and a new file is written. Costs one model's worth of
    tmpfs between syncs, which every sync needs anyway; `discard` (after a failed sync) and `close` remove it.

    Shared parameters (`share`, `rollout.sync.shm_share_parameters`): after a committed sync, the learner's
    CPU parameters that were written as they are move into the files at the bytes they were written to
    (`param.data` becomes a view of the file; one storage per parameter, so checkpoint writers do not take
    them for tied weights). The next sync then finds those tensors already in place and writes only the
    headers: the servers load straight from the learner's memory, and the file copy (bytes / memcpy, the
    cap of any copying transport) is gone. Safe because a file is rewritten or trained in only while no
    server holds it: a sync ends (and the learner trains again) after every server's commit has loaded and
    dropped its link, and `discard` (a failed sync, after which a server may still be reading) first moves
    every shared parameter back into private memory. Parameters that share a storage, live off the CPU, or
    were cast, merged or gathered on export are copied as before.

    Args:
        shm_dir: the staging directory (created when missing).
    """

    def __init__(self, shm_dir: str | Path) -> None:
        self.shm_dir = Path(shm_dir).expanduser()
        self._tag = uuid.uuid4().hex[:12]
        self._spares: dict[int, Path] = {}
        self._written: dict[int, list[tuple[int, int, int]]] = {}
        """Bucket index -> (source address, offset in the file, bytes) of each tensor written by the sync of
        version `_written_version` (an earlier sync's entries would point at bytes training has changed)."""
        self._written_version: int | None = None
        self._mapped: dict[int, _MappedFile] = {}
        """Bucket index -> the mapping that shared parameters of that bucket live in."""
        self._shared: dict[int, tuple[torch.Tensor, _MappedFile]] = {}
        """id -> each parameter moved into a mapping, and that mapping."""
        self.reused_bytes = 0
        """Bytes written into reused (already allocated) files since this stager was made."""
        self.shared_bytes = 0
        """Tensor bytes not written because the parameter already lives at its place in the file."""

    @contextmanager
    def staged(self, version: int, index: int, parts: BucketParts) -> Iterator[str]:
        """Writes one bucket (its parts, in order), yields its plain file name, takes the name back on exit.

        The servers take the file over (a hard link of their own) before acknowledging it, so the name may
        go as soon as every server has acknowledged; the file is kept as the spare of bucket `index`.
        """
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        name = f"rollmatch-{self._tag}-v{version}-b{index}.safetensors"
        final = self.shm_dir / name
        tmp = self.shm_dir / f".{name}.tmp"
        spare = self._spares.pop(index, None)
        layout = _layout(parts)
        try:
            if spare is None or not self._rewrite(index, spare, tmp, parts, layout):
                _write_new(tmp, parts)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SyncError(
                f"cannot write bucket {index} into shm staging dir {self.shm_dir} ({exc.strerror});"
                " check rollout.sync.shm_dir (it must equal the server's server.shm_dir) and free space"
            ) from exc
        if version != self._written_version:
            self._written, self._written_version = {}, version
        self._written[index] = layout[1:]
        try:
            yield name
        finally:
            keep = self.shm_dir / f".rollmatch-{self._tag}-spare-b{index}.safetensors"
            try:
                os.replace(final, keep)
                self._spares[index] = keep
            except OSError:
                final.unlink(missing_ok=True)

    def _rewrite(
        self, index: int, spare: Path, tmp: Path, parts: BucketParts, layout: list[tuple[int, int, int]]
    ) -> bool:
        """Rewrites `spare` in place as `tmp` when no server holds it any more; False (spare removed) if one
        still does, it is not a plain file of ours, or parameters living in it would be overwritten."""
        try:
            fd = os.open(spare, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            spare.unlink(missing_ok=True)
            return False
        try:
            info = os.fstat(fd)
            total = sum(part.nbytes for part in parts)
            mapped = self._mapped.get(index)
            if mapped is not None and mapped.inode != (info.st_dev, info.st_ino):
                mapped = None
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                spare.unlink(missing_ok=True)  # a server still maps it (its sync has not ended): leave it be
                return False
            in_place = self._in_place(mapped, layout) if mapped is not None else set()
            if in_place is None or (in_place and info.st_size != total):
                # A tensor to send lives in this file elsewhere than its place: writing would clobber it.
                spare.unlink(missing_ok=True)
                return False
            if mapped is not None:
                self._evict(mapped, keep=in_place)  # shared parameters this write would land on go private
                if not in_place:
                    del self._mapped[index]
                    mapped = None
            if mapped is not None:
                self.shared_bytes += _write_parts(mapped.buffer, mapped.address, parts, layout)
            else:
                if info.st_size != total:
                    os.ftruncate(fd, total)
                with _map(fd, total) as out:
                    _write_parts(out, None, parts, layout)
        finally:
            os.close(fd)
        os.replace(spare, tmp)
        self.reused_bytes += total
        return True

    def _in_place(self, mapped: _MappedFile, layout: list[tuple[int, int, int]]) -> set[int] | None:
        """Offsets of the parts that already live at their place in `mapped`; None when a part lives in it
        elsewhere (the file cannot be rewritten in place)."""
        in_place = set()
        for source, offset, nbytes in layout:
            if nbytes and mapped.holds_address(source):
                if source != mapped.address + offset:
                    return None
                in_place.add(offset)
        return in_place

    def _evict(self, mapped: _MappedFile, keep: set[int]) -> None:
        """Moves the shared parameters living in `mapped` other than at `keep` offsets into private memory."""
        for key, (param, home) in list(self._shared.items()):
            if home is mapped and mapped.holds(param) and param.data_ptr() - mapped.address not in keep:
                param.data = param.data.clone()
                del self._shared[key]

    def share(self, parameters: Iterable[torch.Tensor]) -> int:
        """Moves every parameter the last sync wrote as it is into its place in the bucket files (see the
        class docstring); call once every server has committed that sync.

        Returns:
            Bytes of parameters that now live in the files (moved now or earlier).
        """
        owners = {p.data_ptr(): p for p in parameters if _owns_its_storage(p)}
        placed = moved = 0
        for index, tensors in self._written.items():
            spare = self._spares.get(index)
            found = [(owners.get(address), offset, n) for address, offset, n in tensors]
            found = [(p, offset, n) for p, offset, n in found if p is not None and n == _nbytes(p)]
            if spare is None or not found:
                continue
            mapped = self._mapped.get(index)
            try:
                if mapped is None or not mapped.is_file(spare):
                    mapped = self._mapped[index] = _MappedFile.open(spare)
            except OSError:
                continue  # the spare went away: these parameters stay private, their bytes are copied
            for param, offset, nbytes in found:
                if (mapped.address + offset) % param.element_size():
                    continue  # a misaligned place (a 2-byte tensor before it): keep copying this one
                if param.data_ptr() != mapped.address + offset:
                    view = torch.frombuffer(
                        mapped.buffer, dtype=param.dtype, count=param.numel(), offset=offset
                    )
                    param.data = view.view(param.shape)
                    self._shared[id(param)] = (param, mapped)
                    moved += nbytes
                placed += nbytes
        self._written = {}
        if moved:
            # Said once per move (normally the first sync): the learner's memory now shows as shared memory.
            logger.info(
                "shm sync: %.1f MB of the learner's parameters now live in the bucket files under %s (%.1f MB"
                " in all) and later syncs copy none of it; rollout.sync.shm_share_parameters: false keeps"
                " them in private memory",
                moved / 1e6,
                self.shm_dir,
                placed / 1e6,
            )
        return placed

    def discard(self) -> None:
        """After a failed sync: moves shared parameters back into private memory (a server may still be
        loading a file) and removes the spares (the next sync starts from new files)."""
        for param, mapped in self._shared.values():
            if mapped.holds(param):
                param.data = param.data.clone()
        self.close()

    def close(self) -> None:
        """Removes the spares and forgets the mappings; shared parameters keep their (now unnamed) memory."""
        self._shared, self._mapped, self._written = {}, {}, {}
        for path in self._spares.values():
            path.unlink(missing_ok=True)
        self._spares = {}


class _MappedFile:
    """A bucket file mapped read-write for the life of the parameters placed in it."""

    def __init__(self, buffer: mmap.mmap, inode: tuple[int, int]) -> None:
        self.buffer = buffer
        self.inode = inode
        self.address = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
        self.size = len(buffer)

    @classmethod
    def open(cls, path: Path) -> _MappedFile:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            return cls(_map(fd, info.st_size), (info.st_dev, info.st_ino))
        finally:
            os.close(fd)

    def is_file(self, path: Path) -> bool:
        info = os.stat(path, follow_symlinks=False)
        return (info.st_dev, info.st_ino) == self.inode

    def holds_address(self, address: int) -> bool:
        return self.address <= address < self.address + self.size

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.holds_address(tensor.data_ptr())


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE maps every page up front: 5.3-5.8 GB/s instead of 2.4 GB/s with a fault per page.
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _write_parts(
    out: mmap.mmap, address: int | None, parts: BucketParts, layout: list[tuple[int, int, int]]
) -> int:
    """Writes each part at its offset in `out` (mapped at `address`), except parts already there; returns
    the bytes that were."""
    in_place = 0
    for part, (source, offset, nbytes) in zip(parts, layout, strict=True):
        if address is not None and nbytes and source == address + offset:
            in_place += nbytes
        else:
            out[offset : offset + nbytes] = part
    return in_place


def _layout(parts: BucketParts) -> list[tuple[int, int, int]]:
    """(address of the part's memory, offset in the file, bytes) of each part, in order."""
    layout, offset = [], 0
    for part in parts:
        address = np.frombuffer(part, dtype=np.uint8).ctypes.data if part.nbytes else 0
        layout.append((address, offset, part.nbytes))
        offset += part.nbytes
    return layout


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _owns_its_storage(param: torch.Tensor) -> bool:
    """A dense CPU tensor that is the whole of its storage (not a view into a flat buffer, e.g. ZeRO's)."""
    return (
        param.device.type == "cpu"
        and param.layout == torch.strided
        and param.numel() > 0
        and param.is_contiguous()
        and param.storage_offset() == 0
        and param.untyped_storage().nbytes() == _nbytes(param)
    )


def _write_new(path: Path, parts: BucketParts) -> None:
    with open(path, "wb", buffering=0) as f:
        for part in parts:
            while part:  # a raw write may be partial
                part = part[f.write(part) :]
