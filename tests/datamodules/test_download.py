"""download_and_extract and ModelNet40(download=True) against a local HTTP server."""

import hashlib
import io
import socket
import tarfile
import zipfile

import numpy as np
import pytest

from attention.errors import UserError
from datamodules import ModelNet40, download_and_extract
from datamodules.modelnet import HDF5_FOLDER


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def release_zip(tmp_path, http_folder, modelnet_release):
    """A zip of a tiny release, served as modelnet40_ply_hdf5_2048.zip; returns (url, md5, written arrays)."""
    served, base = http_folder
    source = tmp_path / "source"
    written = modelnet_release(source / HDF5_FOLDER)
    archive = served / f"{HDF5_FOLDER}.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted((source / HDF5_FOLDER).iterdir()):
            zf.write(path, f"{HDF5_FOLDER}/{path.name}")
    return f"{base}/{HDF5_FOLDER}.zip", md5(archive), written


def test_modelnet_download_then_load(tmp_path, release_zip):
    url, digest, written = release_zip
    root = tmp_path / "data"
    dm = ModelNet40(root=str(root), npoints=32, download=True, url=url, md5=digest)
    dm.prepare_data()
    dm.setup()
    assert (root / HDF5_FOLDER / "ply_data_train1.h5").is_file()
    assert not list(root.glob("*.part"))
    np.testing.assert_array_equal(dm.test_set[0]["points"].numpy(), written["test"][0][0, :32])
    assert dm.class_names[3] == "name3"


def test_verified_archive_is_reused_without_network(tmp_path, release_zip):
    url, digest, _ = release_zip
    root = tmp_path / "data"
    archive = download_and_extract(url, root, md5=digest)
    assert archive == root / f"{HDF5_FOLDER}.zip" and md5(archive) == digest
    (root / HDF5_FOLDER / "ply_data_test0.h5").unlink()
    dead = url.replace(url.split("/")[2], "127.0.0.1:1")  # nothing listens on port 1
    download_and_extract(dead, root, md5=digest, filename=archive.name)
    assert (root / HDF5_FOLDER / "ply_data_test0.h5").is_file()


def test_wrong_md5_deletes_the_file(tmp_path, release_zip):
    url, digest, _ = release_zip
    root = tmp_path / "data"
    dm = ModelNet40(root=str(root), download=True, url=url, md5="0" * 32)
    with pytest.raises(UserError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert url in message and "0" * 32 in message and digest in message
    assert list(root.iterdir()) == []  # neither the zip nor anything extracted


def test_not_an_archive_is_deleted(tmp_path, http_folder):
    served, base = http_folder
    (served / "page.zip").write_text("<html>moved</html>")
    root = tmp_path / "data"
    with pytest.raises(UserError, match="not a zip or tar archive") as err:
        download_and_extract(f"{base}/page.zip", root)
    assert f"{base}/page.zip" in str(err.value)
    assert list(root.iterdir()) == []


def test_truncated_zip_is_deleted(tmp_path, http_folder, release_zip):
    served, base = http_folder
    data = (served / f"{HDF5_FOLDER}.zip").read_bytes()
    (served / "cut.zip").write_bytes(data[: len(data) // 2])
    root = tmp_path / "data"
    with pytest.raises(UserError):
        download_and_extract(f"{base}/cut.zip", root)
    assert list(root.iterdir()) == []


def test_404_and_unreachable_urls(tmp_path, http_folder):
    _, base = http_folder
    with pytest.raises(UserError, match="Could not download") as err:
        download_and_extract(f"{base}/missing.zip", tmp_path / "a")
    assert f"{base}/missing.zip" in str(err.value) and "data.root" in str(err.value)

    with socket.socket() as s:  # a port that was free a moment ago and is now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/{HDF5_FOLDER}.zip"
    with pytest.raises(UserError, match="Could not download") as err:
        ModelNet40(root=str(tmp_path / "b"), download=True, url=url).prepare_data()
    assert url in str(err.value)
    assert not list((tmp_path / "b").glob("*.part"))


def zip_with(member):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("ok/file.txt", "fine")
        zf.writestr(member, "evil")
    return buffer.getvalue()


def tar_with(*members, mode="w:gz"):
    """A tar archive holding ok/file.txt and then ``members`` (TarInfo objects, files get 4 bytes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tf:
        ok = tarfile.TarInfo("ok/file.txt")
        ok.size = 4
        tf.addfile(ok, io.BytesIO(b"fine"))
        for info in members:
            tf.addfile(info, io.BytesIO(b"evil") if info.isfile() else None)
    return buffer.getvalue()


def tar_member(name, kind=tarfile.REGTYPE, target=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    info.size = 4 if kind == tarfile.REGTYPE else 0
    return info


UNSAFE = {
    "zip-dotdot": ("evil.zip", zip_with("../evil"), "../evil"),
    "zip-nested-dotdot": ("evil.zip", zip_with("ok/../../evil"), "ok/../../evil"),
    "zip-absolute": ("evil.zip", zip_with("/tmp/evil"), "/tmp/evil"),
    "tar-symlink-etc": ("evil.tar.gz", tar_with(tar_member("ok/etc", tarfile.SYMTYPE, "/etc")), "ok/etc"),
    "tar-symlink-up": ("evil.tar.gz", tar_with(tar_member("ok/up", tarfile.SYMTYPE, "../../x")), "ok/up"),
    "tar-hardlink": ("evil.tar", tar_with(tar_member("ok/pw", tarfile.LNKTYPE, "/etc/passwd"), mode="w"), "ok/pw"),
    "tar-dotdot": ("evil.tar.gz", tar_with(tar_member("../evil")), "../evil"),
    "tar-fifo": ("evil.tar.gz", tar_with(tar_member("ok/fifo", tarfile.FIFOTYPE)), "ok/fifo"),
}


@pytest.mark.parametrize("case", list(UNSAFE))
def test_unsafe_members_are_refused(tmp_path, http_folder, case):
    served, base = http_folder
    name, payload, member = UNSAFE[case]
    (served / name).write_bytes(payload)
    root = tmp_path / "deep" / "data"
    with pytest.raises(UserError, match="Refusing to extract") as err:
        download_and_extract(f"{base}/{name}", root)
    assert f"'{member}'" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == [name]  # nothing extracted, not even the safe member
    assert not (tmp_path / "deep" / "evil").exists() and not (tmp_path / "evil").exists()


def test_safe_tar_with_internal_symlink_extracts(tmp_path, http_folder):
    served, base = http_folder
    payload = tar_with(tar_member("ok/link", tarfile.SYMTYPE, "file.txt"))
    (served / "good.tgz").write_bytes(payload)
    root = tmp_path / "data"
    download_and_extract(f"{base}/good.tgz", root, md5=hashlib.md5(payload).hexdigest())
    assert (root / "ok" / "link").read_text() == "fine"
