"""download_and_extract, the data sets' data.download=true on the run's path, and releases checked against
their file lists, against a local HTTP server."""

import hashlib
import inspect
import io
import multiprocessing
import socket
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from attention.errors import UserError
from datamodules import ModelNet40, download_and_extract
from datamodules.points.modelnet40 import HDF5_FOLDER


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def contents(root: Path) -> list[str]:
    """The names in ``root``, but the lock file that one download at a time holds (datamodules/download.py)."""
    return sorted(p.name for p in root.iterdir() if p.name != ".download.lock")


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
    assert contents(root) == []  # neither the zip nor anything extracted


def test_not_an_archive_is_deleted(tmp_path, http_folder):
    served, base = http_folder
    (served / "page.zip").write_text("<html>moved</html>")
    root = tmp_path / "data"
    with pytest.raises(UserError, match="not a zip or tar archive") as err:
        download_and_extract(f"{base}/page.zip", root)
    assert f"{base}/page.zip" in str(err.value)
    assert contents(root) == []


def test_truncated_zip_is_deleted(tmp_path, http_folder, release_zip):
    served, base = http_folder
    data = (served / f"{HDF5_FOLDER}.zip").read_bytes()
    (served / "cut.zip").write_bytes(data[: len(data) // 2])
    root = tmp_path / "data"
    with pytest.raises(UserError):
        download_and_extract(f"{base}/cut.zip", root)
    assert contents(root) == []


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
    assert contents(root) == [name]  # nothing extracted, not even the safe member
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
        self.gets, self.seconds = 0, 0.0  # requests served; seconds spent sending each response (in 16 pieces)
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
                server.gets += 1
                step = -(-len(body) // 16) or 1
                for i in range(0, len(body), step):
                    self.wfile.write(body[i:i + step])
                    self.wfile.flush()
                    time.sleep(server.seconds / 16)

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


def _prepare(root: str, url: str, md5: str, start) -> None:
    start.wait()
    ModelNet40(root=root, npoints=32, download=True, url=url, md5=md5).prepare_data()


def test_runs_downloading_at_once_download_once(tmp_path, range_server, modelnet_release):
    """Three runs of a sweep started together on a fresh machine, each with data.download=true: they appended to
    one .part file and extracted over each other's files (a checksum mismatch, or a corrupt release). One now
    downloads and extracts; the others wait for it and find the release in place."""
    source = tmp_path / "source" / HDF5_FOLDER
    written = modelnet_release(source)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path in sorted(source.iterdir()):
            zf.write(path, f"{HDF5_FOLDER}/{path.name}")
    payload = buffer.getvalue()
    server = range_server(payload)
    server.seconds = 1.0  # long enough for every process to start while the first one downloads
    root = tmp_path / "data"
    context = multiprocessing.get_context("fork")
    start = context.Event()
    procs = [context.Process(target=_prepare, args=(str(root), server.url, hashlib.md5(payload).hexdigest(), start))
             for _ in range(3)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    assert server.gets == 1 and server.ranges == []
    dm = ModelNet40(root=str(root), npoints=32)
    dm.setup()
    np.testing.assert_array_equal(dm.test_set[0]["points"].numpy(), written["test"][0][0, :32])
    assert (root / "release.zip").read_bytes() == payload and not list(root.glob("*.part"))


def test_a_file_system_without_locks_downloads_unlocked(tmp_path, range_server, monkeypatch, caplog):
    """Where flock is missing (some network file systems), filelock would fall back to a lock file that a killed
    run leaves behind, and every later run would wait for ever: the download goes on unlocked, with a warning."""
    import errno
    import fcntl
    import logging

    def missing(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", missing)
    payload = zip_with("ok/a.txt")
    server = range_server(payload)
    (tmp_path / ".download.lock").write_text("")  # as a killed run's soft lock would be left
    with caplog.at_level(logging.WARNING):
        download_and_extract(server.url, tmp_path, md5=hashlib.md5(payload).hexdigest())
    assert (tmp_path / "ok" / "a.txt").is_file() and "cannot lock files" in caplog.text


# --- data.download=true on the run's own path (suite.compose), for every data set that offers it ---------------------
def zip_folder(folder, archive, prefix):
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(folder.rglob("*")):
            zf.write(path, f"{prefix}/{path.relative_to(folder)}")


def tar_folder(folder, archive, prefix):
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(folder, arcname=prefix)


def write_cifar100(folder, n=6, seed=0):
    import pickle

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for name in ("train", "test"):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"fine_labels": [int(x) for x in rng.integers(0, 100, n)]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": [f"c{i}".encode() for i in range(100)]}, 2))
    return n


def modelnet_archive(source, served, fixtures):
    written = fixtures["modelnet_release"](source)
    zip_folder(source, served / f"{HDF5_FOLDER}.zip", HDF5_FOLDER)
    return f"{HDF5_FOLDER}.zip", len(written["train"][1])


def shapenet_txt_archive(source, served, fixtures):
    from datamodules.partseg.shapenet import TXT_FOLDER

    written = fixtures["shapenet_txt_release"](source, counts={"train": 2, "val": 1, "test": 1})
    zip_folder(source, served / f"{TXT_FOLDER}.zip", TXT_FOLDER)
    return f"{TXT_FOLDER}.zip", len(written["train"])


def shapenet_h5_archive(source, served, fixtures):
    from datamodules.partseg.shapenet import H5_FOLDER, H5_ZIP_FOLDER

    written = fixtures["shapenet_h5_release"](source, points=64)
    zip_folder(source, served / f"{H5_FOLDER}.zip", H5_ZIP_FOLDER)  # as the official zip unpacks
    return f"{H5_FOLDER}.zip", len(written["train"][1])


def cifar10_archive(source, served, fixtures):
    from test_generation import write_cifar

    data, _ = write_cifar(source)
    tar_folder(source, served / "cifar-10-python.tar.gz", "cifar-10-batches-py")
    return "cifar-10-python.tar.gz", len(data)


def cifar100_archive(source, served, fixtures):
    n = write_cifar100(source)
    tar_folder(source, served / "cifar-100-python.tar.gz", "cifar-100-python")
    return "cifar-100-python.tar.gz", n


# data config -> (the task it belongs to, the archive writer, how many training samples the data module holds)
DOWNLOADS = {
    "modelnet40": ("modelnet data.npoints=32", modelnet_archive, lambda dm: len(dm.train_set)),
    "shapenet_part": ("shapenet", shapenet_txt_archive, lambda dm: len(dm.train_set)),
    "shapenet_part_h5": ("shapenet", shapenet_h5_archive, lambda dm: len(dm.train_set)),
    "cifar10": ("gan", cifar10_archive, lambda dm: len(dm.train_labels)),
    "cifar10_cls": ("classification", cifar10_archive, lambda dm: len(dm.train_set)),
    "cifar100": ("classification", cifar100_archive, lambda dm: len(dm.train_set)),
}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def compose_data(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_every_data_set_that_offers_a_download_is_tested():
    from hydra.utils import get_class

    offering = set()
    for path in (CONFIGS / "data").glob("*.yaml"):
        target = yaml.safe_load(path.read_text())["_target_"]
        if "download" in inspect.signature(get_class(target)).parameters:
            offering.add(path.stem)
    assert offering == set(DOWNLOADS)


@pytest.mark.parametrize("name", list(DOWNLOADS))
def test_the_run_downloads_with_data_download_true(name, tmp_path, http_folder, modelnet_release,
                                                   shapenet_txt_release, shapenet_h5_release, monkeypatch):
    """What run.py composes (suite.compose.build_datamodule) downloads the release from data.url, md5-checked,
    and reads it; the same archive with a wrong data.md5 is refused before anything is read."""
    from suite.compose import build_datamodule

    for var in ("LOCAL_RANK", "NODE_RANK", "SLURM_LOCALID", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    served, base = http_folder
    task, write, count = DOWNLOADS[name]
    fixtures = {"modelnet_release": modelnet_release, "shapenet_txt_release": shapenet_txt_release,
                "shapenet_h5_release": shapenet_h5_release}
    archive, train_size = write(tmp_path / "source", served, fixtures)
    digest = md5(served / archive)
    root = tmp_path / "data"
    overrides = [*f"task={task}".split(), f"data={name}", f"data.root={root}", "data.download=true",
                 f"++data.url={base}/{archive}", f"++data.md5={'0' * 32}"]
    with pytest.raises(UserError, match="Checksum mismatch"):
        build_datamodule(compose_data(overrides), "fit")
    overrides[-1] = f"++data.md5={digest}"
    dm = build_datamodule(compose_data(overrides), "fit")
    assert md5(root / archive) == digest
    assert count(dm) == train_size


@pytest.mark.parametrize("name", list(DOWNLOADS))
def test_only_the_preparing_process_downloads_and_the_others_are_told_why(name, tmp_path, http_folder, modelnet_release,
                                                                          shapenet_txt_release, shapenet_h5_release,
                                                                          monkeypatch):
    """A second process of a node (LOCAL_RANK=1) never downloads (Lightning prepares data on the first one); its
    missing-data message does not tell the user to set data.download=true, which is set."""
    from suite.compose import build_datamodule

    served, base = http_folder
    task, write, _ = DOWNLOADS[name]
    fixtures = {"modelnet_release": modelnet_release, "shapenet_txt_release": shapenet_txt_release,
                "shapenet_h5_release": shapenet_h5_release}
    archive, _ = write(tmp_path / "source", served, fixtures)
    monkeypatch.setenv("LOCAL_RANK", "1")
    root = tmp_path / "data"
    cfg = compose_data([*f"task={task}".split(), f"data={name}", f"data.root={root}", "data.download=true",
                        f"++data.url={base}/{archive}", f"++data.md5={md5(served / archive)}"])
    with pytest.raises(UserError) as err:
        build_datamodule(cfg, "fit")
    message = str(err.value)
    assert "data.download=true is set" in message and "Set data.download=true" not in message
    assert "trainer.devices=1" in message
    assert not root.exists() or not contents(root)


def test_release_that_stays_incomplete_after_the_download_names_the_url(tmp_path, http_folder):
    served, base = http_folder
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "readme.txt").write_text("not the release")
    zip_folder(tmp_path / "source", served / "other.zip", "other")
    with pytest.raises(UserError) as err:
        ModelNet40(root=str(tmp_path / "data"), download=True, url=f"{base}/other.zip").prepare_data()
    message = str(err.value)
    assert f"data.url={base}/other.zip" in message and "still incomplete" in message
    assert "Set data.download=true" not in message


# --- a release checked against its own file lists ------------------------------------------------------------------
def test_modelnet_release_missing_a_listed_shard_is_refused(tmp_path, modelnet_release):
    folder = tmp_path / HDF5_FOLDER
    modelnet_release(folder, train_sizes=(3, 2, 2), test_sizes=(2, 2))
    (folder / "train_files.txt").write_text("".join(f"data/{HDF5_FOLDER}/ply_data_train{i}.h5\n" for i in range(3)))
    (folder / "test_files.txt").write_text("".join(f"data/{HDF5_FOLDER}/ply_data_test{i}.h5\n" for i in range(2)))
    dm = ModelNet40(root=str(tmp_path), npoints=32)
    dm.setup()
    assert len(dm.train_set) == 7  # complete: every listed shard is read
    (folder / "ply_data_train1.h5").unlink()
    (folder / "ply_data_test1.h5").unlink()
    with pytest.raises(UserError) as err:
        ModelNet40(root=str(tmp_path), npoints=32).setup()
    message = str(err.value)
    assert "ply_data_train1.h5 listed in train_files.txt is missing" in message
    assert "ply_data_test1.h5 listed in test_files.txt is missing" in message
    assert str(folder) in message and f"{HDF5_FOLDER}.zip" in message and "data.download=true" in message


def test_missing_shard_is_restored_from_the_kept_archive_with_download(tmp_path, release_zip):
    url, digest, written = release_zip
    root = tmp_path / "data"
    ModelNet40(root=str(root), npoints=32, download=True, url=url, md5=digest).prepare_data()
    folder = root / HDF5_FOLDER
    (folder / "train_files.txt").write_text("ply_data_train0.h5\nply_data_train1.h5\n")
    (folder / "ply_data_train1.h5").unlink()
    dead = url.replace(url.split("/")[2], "127.0.0.1:1")  # the kept archive is used: no network
    dm = ModelNet40(root=str(root), npoints=32, download=True, url=dead, md5=digest)
    dm.prepare_data()
    dm.setup()
    assert len(dm.train_set) == len(written["train"][1])


def test_a_release_that_is_there_but_wrong_is_not_unpacked_over(tmp_path, http_folder, modelnet_release):
    """With data.download=true, every error of the release's checks unpacked the official archive over the folder:
    lists a user edited so that they shared a shard (or any list refused) were replaced by the official ones
    without a word, and the run trained on those. Only a missing release (or missing files) is downloaded now."""
    served, base = http_folder
    source = tmp_path / "source" / HDF5_FOLDER
    modelnet_release(source)
    (source / "train_files.txt").write_text("ply_data_train0.h5\nply_data_train1.h5\n")  # the official lists
    (source / "test_files.txt").write_text("ply_data_test0.h5\n")
    with zipfile.ZipFile(served / f"{HDF5_FOLDER}.zip", "w") as zf:
        for path in sorted(source.iterdir()):
            zf.write(path, f"{HDF5_FOLDER}/{path.name}")
    url, root = f"{base}/{HDF5_FOLDER}.zip", tmp_path / "data"
    ModelNet40(root=str(root), npoints=32, download=True, url=url).prepare_data()
    edited = "ply_data_train0.h5\nply_data_test0.h5\n"
    (root / HDF5_FOLDER / "train_files.txt").write_text(edited)
    with pytest.raises(UserError, match=r"reads 1 file\(s\) in both the train split") as err:
        ModelNet40(root=str(root), npoints=32, download=True, url=url).prepare_data()
    assert "downloaded" not in str(err.value)
    assert (root / HDF5_FOLDER / "train_files.txt").read_text() == edited  # the user's file, as they wrote it
