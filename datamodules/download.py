"""Download, verify and safely extract a dataset archive.

:func:`download_and_extract` fetches ``url`` into ``root`` (progress bar),
checks it, and unpacks it into ``root``::

    <root>/<filename>.part   while downloading; an interrupted download is
                             resumed from here (HTTP Range) by the next run,
                             or restarted when the server cannot resume
    <root>/<filename>        the complete archive, only ever renamed from
                             .part once all bytes arrived; kept so that a
                             re-run does not download it again
    <root>/<filename>.md5    the md5 pinned at first use when no md5 is
                             configured (see below)
    <root>/...               the archive's members

Checks, each failing with a :class:`~attention.errors.UserError` that names the
URL or file:

* the server is reachable and sends the whole file (else: run again to resume,
  or download by hand into ``data.root``);
* the md5 matches: the configured ``md5``, or, for releases that publish none
  (ModelNet40 and ShapeNet part: no checksum is published for them), the md5
  recorded the first time the archive was downloaded and found complete (a
  later download that differs is refused); expected and actual sums are
  reported and the bad file is deleted;
* the file is a readable zip or tar (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz)
  archive (else it is deleted);
* every member stays inside ``root``: absolute names, ``..`` components, and
  tar links, devices or other special members are refused before anything is
  written.

One process at a time downloads and extracts into a ``root``
(:func:`one_download_at_a_time`, a lock file ``<root>/.download.lock``): the runs of a
sweep started together on a fresh machine or a shared file system appended to
one ``.part`` file and extracted over each other's files; the others now wait,
then find the release in place (:func:`ensure_release` checks again).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import posixpath
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from tqdm.auto import tqdm

from attention.errors import UserError
from datamodules.base import describe
from datamodules.cache import one_at_a_time

log = logging.getLogger(__name__)

T = TypeVar("T")


def download_and_extract(
    url: str, root: str | os.PathLike, md5: str | None = None, filename: str | None = None
) -> Path:
    """Download ``url`` into ``root``, verify it and extract it into ``root``.

    Args:
        url: where to fetch the archive (http, https or file).
        root: folder to download into and extract into; created if missing.
        md5: expected md5 hex digest of the archive, or None to skip that check
            (the file must still be a valid zip or tar archive).
        filename: name to save the archive under; defaults to the URL's basename.

    Returns:
        The path of the verified archive (kept next to the extracted files).

    Raises:
        UserError: unreachable URL, checksum mismatch, not an archive, or an
            unsafe archive member.
    """
    root = Path(root).expanduser()
    with one_download_at_a_time(root, url):
        return _download_and_extract(url, root, md5, filename)


def _download_and_extract(url: str, root: Path, md5: str | None, filename: str | None) -> Path:
    name = filename or posixpath.basename(url.split("?", 1)[0]) or "download"
    archive = root / name
    pin = root / (name + ".md5")
    pinned = md5 is None and pin.is_file()
    if md5 is None and pinned:
        md5 = pin.read_text().split()[0]
    if archive.is_file() and md5 is not None and _md5(archive) != md5.lower():
        archive.unlink()  # a stale or corrupt earlier download: fetch it again
    if not archive.is_file():
        _fetch(url, root, name)
    _verify(archive, url, md5, pinned=pin if pinned else None)
    _extract(archive, root)
    if md5 is None:  # no published checksum: pin this complete, safe archive's md5 for every later download
        digest = _md5(archive)
        pin.write_text(f"{digest}  {name}\n")
        log.warning("No md5 is configured for %s; the archive is complete and safe, md5 %s, now pinned in %s (set "
                    "data.md5=%s to pin it in the config).", url, digest, pin, digest)
    return archive


class ReleaseMissing(UserError):
    """A data set's release is not there, or lacks files: what a download (``data.download=true``) puts right.
    Other UserErrors of a release's checks (lists that overlap, a list not in UTF-8) are the user's files, which
    unpacking the official archive over them would replace without a word."""


def ensure_release(check: Callable[[], T], download: bool, url: str, root: str | os.PathLike,
                   md5: str | None = None) -> T:
    """Return ``check()``; if it finds the release missing (:class:`ReleaseMissing`) and ``download`` is set, fetch
    and extract ``url`` into ``root`` first, then check again. Without ``download`` the error stands, and so does
    any other error of ``check`` (the release is there but wrong: the message says what to fix); a release still
    incomplete after the download is an error naming the URL (``data.url`` is not the official archive)."""
    try:
        return check()
    except ReleaseMissing:
        if not download:
            raise
    with one_download_at_a_time(Path(root).expanduser(), url):
        try:
            return check()  # another run put it in place while this one waited
        except ReleaseMissing:
            download_and_extract(url, root, md5=md5)
    try:
        return check()
    except UserError as err:
        raise UserError(f"The archive downloaded from data.url={url} was unpacked into {root}, yet the release is "
                        f"still incomplete: {err}") from None


def one_download_at_a_time(root: Path, url: str):
    """The lock ``<root>/.download.lock`` (:func:`datamodules.cache.one_at_a_time`)."""
    return one_at_a_time(root, ".download.lock", f"downloading {url} into {root}")


_warned: set[tuple[Path, tuple[str, ...]]] = set()  # (folder, unread files) already named by release_files


def read_lines(path: Path, what: str, fix: str) -> list[str]:
    """The lines of the list file ``path``, read as UTF-8 (a UTF-8 byte-order mark, as Windows editors write, is
    dropped). UserError naming the file when it cannot be read or is not UTF-8 (a UTF-16 file saved by Notepad):
    ``what`` says what a line holds ("one image id a line"), ``fix`` how else to repair it (a sentence)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path} cannot be read ({err}). {fix}") from None
    try:
        return data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        # UTF-16 starts with a byte-order mark, FF FE or FE FF: say so, it is how Notepad saves "Unicode"
        utf16 = " (it looks like UTF-16, as Windows Notepad saves \"Unicode\")" if data[:2] in (b"\xff\xfe",
                                                                                              b"\xfe\xff") else ""
        raise UserError(
            f"{path} is not UTF-8 text{utf16}: byte {err.start} is {data[err.start:err.start + 1]!r} "
            f"({err.reason}). It must be UTF-8 text, {what}. Save it again as UTF-8 (e.g. iconv -f UTF-16 -t UTF-8 "
            f"old.txt > {path.name}). {fix}"
        ) from None


def release_files(folder: Path, splits: dict[str, tuple[str, str]], release: str, archive: str, root, url: str,
                  order: Callable[[Iterable[Path]], list[Path]] = sorted) -> dict[str, list[Path]]:
    """The files of each split of a release in ``folder``; ``splits``: split -> (the release's list of the split's
    files, e.g. ``train_files.txt``, and the glob of them, e.g. ``ply_data_train*.h5``).

    A list that is present decides: exactly the files it names (one path a line, the folder's files by their last
    component), in its order, so that a stray copy the glob would match (``ply_data_train0 (1).h5`` from unzipping
    twice, a test file saved under a train name) is not read; the .h5 files that no list names are then named in a
    warning. Without its list a split reads the files its glob matches, in ``order``.

    UserError naming the files and how to restore them (``release``: how the message names the release, ``archive``
    its zip): a listed file is missing (the run would use part of the data), a list names a file twice or no file,
    or a file belongs to two splits (test data would train)."""
    files, sources, missing, listed = {}, {}, {}, []
    restore = f"restore it from the official {archive} (unzip it again into data.root={root})"
    for split, (name, pattern) in splits.items():
        listing = folder / name
        if not listing.is_file():
            files[split], sources[split] = order(folder.glob(pattern)), f"the {pattern} files (no {name})"
            continue
        lines = read_lines(listing, f"one file of the {release} release a line",
                           f"Or {restore}, or delete it to read the {pattern} files.")
        names = [line.strip().replace("\\", "/").rsplit("/", 1)[-1] for line in lines]
        names = [n for n in names if n]
        if not names:
            raise UserError(f"{listing} names no files; expected one file of the {release} release a line "
                            f"(e.g. {pattern.replace('*', '0')}): {restore}, or delete it to read the {pattern} files.")
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)
        if repeated:
            raise UserError(
                f"{listing} names {len(repeated)} file(s) more than once: {describe(repeated)}; their samples would be "
                f"read twice. Each file must be listed once: remove the repeated lines, or {restore}."
            )
        lacking = [n for n in names if not (folder / n).is_file()]
        if lacking:
            missing[name] = lacking
        files[split], sources[split] = [folder / n for n in names], name
        listed.append(name)
    if missing:
        raise ReleaseMissing(
            f"The {release} release in {folder} is incomplete: "
            + "; ".join(f"{', '.join(files)} listed in {name} {'is' if len(files) == 1 else 'are'} missing"
                        for name, files in missing.items())
            + f", so the run would use only part of the data. Restore the missing file(s) from the official "
            f"{archive} (unzip it again into data.root={root}); with data.download=true a kept {archive} is "
            f"unpacked again, else it is downloaded ({url})."
        )
    split_names = list(files)
    for i, first in enumerate(split_names):
        for second in split_names[i + 1:]:
            shared = sorted({p.name for p in files[first]} & {p.name for p in files[second]})
            if shared:
                raise UserError(
                    f"The {release} release in {folder} reads {len(shared)} file(s) in both the {first} split "
                    f"({sources[first]}) and the {second} split ({sources[second]}): {describe(shared)}. A file must "
                    f"belong to one split, else the same samples are trained on and tested on. Remove each from the "
                    f"list of the split it does not belong to; the official lists are disjoint: restore them from "
                    f"{archive} (unzip it again into data.root={root})."
                )
    if listed:  # without a list the globs decide, as they always did: nothing to warn about
        read = {p.name for paths in files.values() for p in paths}
        unread = sorted(p.name for p in folder.glob("*.h5") if p.name not in read)
        if unread and (folder, tuple(unread)) not in _warned:  # once: prepare_data and setup both ask
            _warned.add((folder, tuple(unread)))
            log.warning("%s holds %d .h5 file(s) that the %s release's file lists (%s) do not name, so they are not "
                        "read: %s. Delete them (a copy from unzipping twice, a file saved under a split's name), or "
                        "add each to the list of its split if it belongs to the release.", folder, len(unread),
                        release, ", ".join(listed), describe(unread))
    return files


def how_to_get(download: bool, url: str, archive: str, offline: str | None = None) -> str:
    """The last sentence of a missing-release message: how to get the release, which depends on whether
    ``data.download`` is already set (then the download did not run in this process)."""
    offline = f", or run offline with data={offline}" if offline else ""
    if not download:
        return f"Set data.download=true to fetch it ({url}), unpack {archive} there by hand{offline}."
    return (f"data.download=true is set, but the download ({url}) runs in the data module's prepare_data(), on the "
            f"first process of each node, before the data is read (run.py and Lightning call it), and a process "
            f"started beside that one (by srun) does not wait for it: run the command once with one process to "
            f"download it (add trainer.devices=1 trainer.num_nodes=1 trainer.fast_dev_run=true), unpack {archive} "
            f"there by hand{offline}.")


def _fetch(url: str, root: Path, name: str) -> None:
    """Download ``url`` to ``root/name`` through ``root/name.part``, resuming a ``.part`` left by an interrupted run.

    Written by hand rather than with torchvision's ``download_url``, which always starts over: dataset archives
    are hundreds of MB to GB, and an interrupted download should cost only what is missing.
    """
    part = root / (name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    try:
        try:
            _stream(url, part, offset)
        except urllib.error.HTTPError as err:
            if err.code != 416 or not offset:  # 416: the .part is not a prefix the server can continue
                raise
            part.unlink()
            _stream(url, part, 0)
    except _Incomplete as err:
        raise UserError(
            f"The download of {url} stopped after {err.got} of {err.total} bytes; the part is kept in {part}. Run "
            f"the same command again to resume it, or download the file by hand into data.root={root}."
        ) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
        raise UserError(
            f"Could not download {url} ({err}). Check the URL and your network, then run again (a partial "
            f"download in {part} is resumed), or download the file by hand and unpack it into data.root={root}."
        ) from None
    part.replace(root / name)


class _Incomplete(Exception):
    def __init__(self, got: int, total: int):
        super().__init__(f"{got} of {total} bytes")
        self.got, self.total = got, total


def _stream(url: str, part: Path, offset: int) -> None:
    """Write ``url`` into ``part``, from byte ``offset`` when the server honours the Range request."""
    headers = {"User-Agent": "attention-suite"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as response:
        status = getattr(response, "status", None) or 200
        resumed = offset > 0 and status == 206 and (response.headers.get("Content-Range") or "").startswith(
            f"bytes {offset}-")
        start = offset if resumed else 0
        length = response.headers.get("Content-Length")
        total = start + int(length) if length and length.isdigit() else None
        if resumed:
            log.info("resuming the download of %s at byte %d", url, start)
        with open(part, "ab" if resumed else "wb") as f, tqdm(
                total=total, initial=start, unit="B", unit_scale=True, unit_divisor=1024, desc=part.name[:-5],
                disable=None) as bar:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
    got = part.stat().st_size
    if total is not None and got != total:
        raise _Incomplete(got, total)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(archive: Path, url: str, md5: str | None, pinned: Path | None = None) -> None:
    """Check the md5 (when given) and that ``archive`` is a readable archive; delete it if not."""
    if md5 is not None:
        actual = _md5(archive)
        if actual != md5.lower():
            archive.unlink()
            source = (f"the md5 pinned in {pinned} when it was first downloaded" if pinned is not None
                      else "data.md5")
            raise UserError(
                f"Checksum mismatch for {archive} downloaded from {url}: expected md5 {md5.lower()} ({source}), "
                f"got {actual}. The file was deleted; retry, or, if the release really changed, "
                + (f"delete {pinned}." if pinned is not None else "fix data.md5.")
            )
    if zipfile.is_zipfile(archive):
        try:
            with zipfile.ZipFile(archive) as zf:
                bad = zf.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            bad = f"({err})"
        if bad is None:
            return
        problem = f"a corrupt zip archive (bad member {bad})"
    elif _is_tar(archive):
        return
    else:
        problem = "not a zip or tar archive"
    archive.unlink()
    raise UserError(
        f"{archive} downloaded from {url} is {problem}. The file was deleted; retry, or download it by "
        f"hand and unpack it into data.root={archive.parent}."
    )


def _is_tar(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except (OSError, EOFError, tarfile.TarError):
        return False


def _unsafe_name(name: str) -> bool:
    """True for absolute member names and names with ``..`` components."""
    normalized = name.replace("\\", "/")
    if normalized.startswith("/") or (len(normalized) > 1 and normalized[1] == ":"):
        return True
    return ".." in normalized.split("/")


def _inside(root: Path, target: str) -> bool:
    """Whether ``target`` (relative to ``root``, possibly with ``..``) stays inside ``root``."""
    base = os.path.realpath(root)
    resolved = os.path.realpath(os.path.join(base, target))
    return os.path.commonpath([base, resolved]) == base


def _refuse(archive: Path, member: str, why: str) -> UserError:
    return UserError(
        f"Refusing to extract {archive}: member '{member}' {why}. The archive is not the expected "
        f"release; delete it and download the official file, or unpack a trusted copy by hand."
    )


def _extract(archive: Path, root: Path) -> None:
    """Extract a zip or tar archive into ``root`` after checking every member."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if _unsafe_name(name):
                    raise _refuse(archive, name, "has an absolute path or a '..' component")
            zf.extractall(root)
        return
    try:
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            for m in members:
                _check_tar_member(archive, root, m)
            tf.extractall(root, members=members, filter="data")
    except (tarfile.ReadError, tarfile.CompressionError, EOFError, zlib.error) as err:
        archive.unlink(missing_ok=True)
        raise UserError(
            f"{archive} is a truncated or corrupt tar archive ({err}). The file was deleted; retry, "
            f"or unpack a good copy by hand into data.root={root}."
        ) from None


def _check_tar_member(archive: Path, root: Path, m: tarfile.TarInfo) -> None:
    """Refuse tar members that would write or point outside ``root``, and special files."""
    if _unsafe_name(m.name):
        raise _refuse(archive, m.name, "has an absolute path or a '..' component")
    if m.issym():
        link_target = posixpath.join(posixpath.dirname(m.name), m.linkname)
        if m.linkname.startswith("/") or not _inside(root, link_target):
            raise _refuse(archive, m.name, f"is a symlink to '{m.linkname}' outside the target folder")
    elif m.islnk():
        if _unsafe_name(m.linkname) or not _inside(root, m.linkname):
            raise _refuse(archive, m.name, f"is a hard link to '{m.linkname}' outside the target folder")
    elif not (m.isfile() or m.isdir()):
        raise _refuse(archive, m.name, "is a device, fifo or other special file")
