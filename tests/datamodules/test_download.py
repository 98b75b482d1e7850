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
from datamodules.points.modelnet40 import HDF5_FOLDER


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


# --- interrupted downloads and pinned checksums --------------------------------------------------------------------
class _RangeServer:
    """127.0.0.1 server of one payload: honours `Range: bytes=N-` (206) and can cut the next response short
    after `cut` bytes while announcing the full length, as a dropped connection does."""

    def __init__(self, payload: bytes):
        import http.server
        import threading

        self.payload, self.cut, self.ranges = payload, None, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                start = 0
                if rng := self.headers.get("Range"):
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    server.ranges.append(start)
                body = server.payload[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(server.payload) - 1}/{len(server.payload)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut is not None:
                    body, server.cut = body[:server.cut], None
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/release.zip"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def range_server():
    servers = []
    yield lambda payload: servers.append(_RangeServer(payload)) or servers[-1]
    for s in servers:
        s.close()


def test_interrupted_download_is_kept_then_resumed(tmp_path, range_server):
    payload = zip_with("ok/more.txt")
    server = range_server(payload)
    server.cut = len(payload) // 3
    with pytest.raises(UserError, match=r"stopped after \d+ of \d+ bytes.*Run the same command again to resume"):
        download_and_extract(server.url, tmp_path, md5=hashlib.md5(payload).hexdigest())
    part = tmp_path / "release.zip.part"
    assert part.stat().st_size == len(payload) // 3 and not (tmp_path / "release.zip").exists()  # never used
    download_and_extract(server.url, tmp_path, md5=hashlib.md5(payload).hexdigest())
    assert server.ranges == [len(payload) // 3]  # only the missing bytes were asked for
    assert (tmp_path / "release.zip").read_bytes() == payload and not part.exists()
    assert (tmp_path / "ok" / "more.txt").read_text() == "evil"


def test_md5_is_pinned_at_first_use_when_none_is_configured(tmp_path, range_server):
    first = zip_with("ok/a.txt")
    server = range_server(first)
    download_and_extract(server.url, tmp_path)
    pin = tmp_path / "release.zip.md5"
    assert pin.read_text().split()[0] == hashlib.md5(first).hexdigest()
    # The server now sends another file under the same name: refused against the pinned sum, and deleted.
    (tmp_path / "release.zip").unlink()
    server.payload = zip_with("ok/b.txt")
    with pytest.raises(UserError, match="Checksum mismatch.*pinned in") as err:
        download_and_extract(server.url, tmp_path)
    assert hashlib.md5(server.payload).hexdigest() in str(err.value)
    assert not (tmp_path / "release.zip").exists()
