"""Readers follow their source files: torch-geometric's processed folders are rebuilt when the raw files change,
ModelNet40PyG's clouds are in unit-sphere units whatever the mesh units, and the classification folders count
every image torchvision's ImageFolder counts, refusing loose ones and naming dangling links."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from test_classification_data import COLOURS, EVAL, imagenet_tree, write_jpeg
from test_modelnet import CUBE, TETRAHEDRON, pyg_root  # noqa: F401 - pyg_root is a fixture
from test_shapenet import pyg  # noqa: F401 - a fixture

from attention.errors import UserError
from datamodules import FolderClassification, ImageNet, ModelNet40PyG, ShapeNetPartPyG
from datamodules.formats.pyg import FINGERPRINT_FILE
from datamodules.points.modelnet40 import MODELNET40_CLASSES


def cube_off(scale: float, shift: tuple[float, float, float]) -> str:
    """CUBE (vertices +-1) in other units and off the origin, as Princeton's meshes are."""
    lines = CUBE.splitlines()
    vertices = [[float(v) * scale + d for v, d in zip(line.split(), shift)] for line in lines[2:10]]
    return "\n".join(lines[:2] + [" ".join(f"{v:g}" for v in row) for row in vertices] + lines[10:]) + "\n"


# ---------------------------------------------------------------------------
# torch-geometric: processed/ follows raw/


def test_modelnet_pyg_reprocesses_when_raw_meshes_change(pyg_root, caplog):
    raw = pyg_root / "raw"
    dm = ModelNet40PyG(root=str(pyg_root), npoints=32)
    dm.setup()
    assert sorted(dm.train_set.labels.tolist()) == [0, 0, 1, 1, 2, 2]
    assert (pyg_root / "processed" / FINGERPRINT_FILE).is_file()
    # The raw folder completed (a category added), a mesh removed and one edited after the first processing.
    chair = MODELNET40_CLASSES.index("chair")
    for split, count in (("train", 3), ("test", 1)):
        (raw / "chair" / split).mkdir()
        for i in range(count):
            (raw / "chair" / split / f"chair_{i + 1:04d}.off").write_text(TETRAHEDRON)
    (raw / "bed" / "train" / "bed_0002.off").unlink()
    (raw / "airplane" / "test" / "airplane_0001.off").write_text(cube_off(3.0, (0, 0, 0)))
    with caplog.at_level(logging.INFO, logger="datamodules.formats.pyg"):
        dm = ModelNet40PyG(root=str(pyg_root), npoints=32, augment=False)
        dm.setup()
    assert "changed since they were made" in caplog.text
    assert sorted(dm.train_set.labels.tolist()) == [0, 0, 1, 1, 2, chair, chair, chair]
    assert sorted(dm.test_set.labels.tolist()) == [0, 1, 2, chair]
    airplane = dm.test_set.source.dataset[0].pos  # PyG's cloud in mesh units: on the new cube, not the tetrahedron
    assert torch.allclose(airplane.abs().amax(dim=1), torch.full((32,), 3.0), atol=1e-5)
    # Unchanged raw files: loaded, not processed again.
    made = (pyg_root / "processed" / "training.pt").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="datamodules.formats.pyg"):
        ModelNet40PyG(root=str(pyg_root), npoints=32).setup()
    assert "Reprocessing" not in caplog.text and (pyg_root / "processed" / "training.pt").stat().st_mtime_ns == made


def test_pyg_processed_without_fingerprint_or_of_another_version_is_rebuilt(pyg_root, caplog, monkeypatch):
    ModelNet40PyG(root=str(pyg_root), npoints=32).setup()
    processed = pyg_root / "processed"
    # An older version's folder, stale: no fingerprint, and a test.pt that holds the 6 train meshes.
    (processed / FINGERPRINT_FILE).unlink()
    shutil.copy(processed / "training.pt", processed / "test.pt")
    with caplog.at_level(logging.INFO, logger="datamodules.formats.pyg"):
        dm = ModelNet40PyG(root=str(pyg_root), npoints=32)
        dm.setup()
    assert "no fingerprint" in caplog.text and len(dm.test_set) == 3
    # What the module makes of the processed files changed (process_version): rebuilt once more.
    shutil.copy(processed / "training.pt", processed / "test.pt")
    monkeypatch.setattr(ModelNet40PyG, "process_version", ModelNet40PyG.process_version + 1)
    dm = ModelNet40PyG(root=str(pyg_root), npoints=32)
    dm.setup()
    assert len(dm.test_set) == 3


def test_shapenet_pyg_reprocesses_when_raw_files_change(pyg):
    root, written = pyg
    dm = ShapeNetPartPyG(root=str(root), npoints=16)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4, 2, 3)
    # A shape file corrected (every point now the category's last part) and the test list shortened.
    path, category, values = written["train"][0]
    last = {0: 3, 1: 5, 11: 37}[category]
    edited = values.copy()
    edited[:, 6] = last
    np.savetxt(path, edited, fmt="%.6f")
    test_list = root / "raw" / "train_test_split" / "shuffled_test_file_list.json"
    test_list.write_text(json.dumps(json.loads(test_list.read_text())[:1]))
    dm = ShapeNetPartPyG(root=str(root), npoints=16)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4, 2, 1)
    assert dm.train_set[0]["parts"].tolist() == [last] * 16


# ---------------------------------------------------------------------------
# ModelNet40PyG: clouds in unit-sphere units


def test_modelnet_pyg_clouds_are_on_the_unit_sphere_whatever_the_mesh_units(pyg_root):
    # The same cube in mesh units (airplane) and 40 times larger, far off the origin (bathtub).
    (pyg_root / "raw" / "airplane" / "test" / "airplane_0001.off").write_text(CUBE)
    (pyg_root / "raw" / "bathtub" / "test" / "bathtub_0001.off").write_text(cube_off(40.0, (300, -7, 2)))
    dm = ModelNet40PyG(root=str(pyg_root), npoints=256, augment=False)
    dm.setup()
    assert dm.test_set.labels[:2].tolist() == [0, 1]
    clouds = []
    unseeded = dm.test_set.source.seeded((0,))
    unseeded.key = None  # from torch's generator (a test cloud's own seed is its index's: another draw per mesh)
    for i in range(2):
        torch.manual_seed(0)  # the same draw of faces and barycentric weights for both meshes
        clouds.append(torch.from_numpy(unseeded.points(i)).float())
    for cloud in [*clouds, dm.test_set[0]["points"], dm.test_set[1]["points"]]:
        assert torch.allclose(cloud.mean(dim=0), torch.zeros(3), atol=1e-6)
        assert abs(float(cloud.norm(dim=1).max()) - 1) < 1e-6
    assert torch.allclose(clouds[0], clouds[1], atol=1e-5)


# ---------------------------------------------------------------------------
# Classification folders: every image counted, none silently left out


def test_loose_images_beside_the_class_folders_are_refused(tmp_path):
    root = imagenet_tree(tmp_path / "imnet", val=3)
    # valprep.sh interrupted: 7 of the 9 val images still loose in val/.
    val_images = sorted((root / "val").glob("*/*.JPEG"))
    for path in val_images[2:]:
        path.rename(root / "val" / path.name)
    with pytest.raises(UserError) as err:
        FolderClassification(str(root), **EVAL).setup()
    message = str(err.value)
    assert f"{root / 'val'} holds 7 image file(s) beside its class folders" in message
    assert val_images[2].name in message and "... (7 in all)" in message
    assert "Move each into its class folder" in message
    with pytest.raises(UserError, match=r"holds 7 image file.*valprep\.sh"):
        ImageNet(str(root), num_classes=3, **EVAL).setup()
    # Sorted again: a loose script, a listing and a hidden file are no images and stay ignored.
    for path in val_images[2:]:
        (root / "val" / path.name).rename(path)
    for name in ("valprep.sh", "LOC_val_solution.csv", ".DS_Store"):
        (root / "val" / name).write_text("x")
    dm = FolderClassification(str(root), **EVAL)
    dm.setup()
    assert len(dm.val_set) == 9


def test_images_in_nested_folders_count_for_their_class_as_in_torchvision(tmp_path):
    from torchvision.datasets import ImageFolder

    root = imagenet_tree(tmp_path / "imnet")
    first = sorted(COLOURS)[0]
    for i in range(2):  # a class tar unpacked into its own folder, one level or two down
        write_jpeg(root / "train" / first / first / f"{first}_nested_{i}.JPEG", COLOURS[first])
    write_jpeg(root / "train" / first / "a" / "b" / "deep.png", COLOURS[first])
    (root / "train" / first / "notes.txt").write_text("not an image")  # no image name: ignored by both
    (root / "train" / first / ".DS_Store").write_bytes(b"\0")
    dm = FolderClassification(str(root), **EVAL)
    dm.setup()
    source = dm.train_set.source
    assert len(source) == 12 and (source.labels == 0).sum() == 6
    ours = [(str(source.path(i)), int(source.labels[i])) for i in range(len(source))]
    assert ours == ImageFolder(str(root / "train")).samples  # the same files, labels and order


def test_a_dangling_symlink_is_a_bad_file(tmp_path, caplog):
    root = imagenet_tree(tmp_path / "imnet")
    link = root / "train" / sorted(COLOURS)[1] / "moved.JPEG"
    os.symlink(tmp_path / "elsewhere" / "moved.JPEG", link)  # its target moved away
    for verify in ("auto", False):  # named at set-up even where the images are not decoded then (ImageNet)
        with pytest.raises(UserError) as err:
            FolderClassification(str(root), verify_images=verify, **EVAL).setup()
        assert str(link) in str(err.value) and "does not exist" in str(err.value)
        assert "data.on_bad_file=skip" in str(err.value)
    dm = FolderClassification(str(root), on_bad_file="skip", **EVAL)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert len(dm.train_set) == 9 and len(dm.skipped) == 1 and str(link) in dm.skipped[0]
    assert "Skipped 1 dangling symbolic link(s)" in caplog.text
