"""Download, verify and safely extract a dataset archive.

:func:`download_and_extract` fetches ``url`` into ``root`` with torchvision's
``download_url`` (progress bar), checks it, and unpacks it into ``root``::

    <root>/<filename>.part   while downloading (removed on any failure)
    <root>/<filename>        the verified archive, kept so that a re-run with
                             the same md5 does not download it again
    <root>/...               the archive's members

Checks, each failing with a :class:`~attention.errors.UserError` that names the
URL or file:

* the server is reachable and sends the file (else: download by hand into
  ``data.root``);
* the md5 matches when one is given (expected and actual sums are reported and
  the bad file is deleted);
* the file is a readable zip or tar (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz)
  archive (else it is deleted);
* every member stays inside ``root``: absolute names, ``..`` components, and
  tar links, devices or other special members are refused before anything is
  written.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import posixpath
import tarfile
import urllib.error
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torchvision.datasets.utils import download_url

from attention.errors import UserError

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
    name = filename or posixpath.basename(url.split("?", 1)[0]) or "download"
    archive = root / name
    if archive.is_file() and md5 is not None and _md5(archive) != md5.lower():
        archive.unlink()  # a stale or corrupt earlier download: fetch it again
    if not archive.is_file():
        _fetch(url, root, name)
    _verify(archive, url, md5)
    _extract(archive, root)
    return archive


def ensure_release(check: Callable[[], T], download: bool, url: str, root: str | os.PathLike,
                   md5: str | None = None) -> T:
    """Return ``check()``; if it finds the release missing (UserError) and ``download`` is set, fetch
    and extract ``url`` into ``root`` first, then check again. Without ``download`` the error stands."""
    try:
        return check()
    except UserError:
        if not download:
            raise
    download_and_extract(url, root, md5=md5)
    return check()


def _fetch(url: str, root: Path, name: str) -> None:
    """Download ``url`` to ``root/name`` through a ``.part`` file."""
    part = root / (name + ".part")
    part.unlink(missing_ok=True)
    try:
        download_url(url, str(root), filename=part.name)
    except (urllib.error.URLError, http.client.HTTPException, OSError, RuntimeError, ValueError) as err:
        part.unlink(missing_ok=True)
        raise UserError(
            f"Could not download {url} ({err}). Check the URL and your network, or download the "
            f"file by hand and unpack it into data.root={root}."
        ) from None
    part.replace(root / name)


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(archive: Path, url: str, md5: str | None) -> None:
    """Check the md5 (when given) and that ``archive`` is a readable archive; delete it if not."""
    if md5 is not None:
        actual = _md5(archive)
        if actual != md5.lower():
            archive.unlink()
            raise UserError(
                f"Checksum mismatch for {archive} downloaded from {url}: expected md5 {md5.lower()}, "
                f"got {actual}. The file was deleted; retry, or fix the md5 option if the release changed."
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
