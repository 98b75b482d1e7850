"""Split lists decide what each split reads, and splits never share data: a test image or shape that the train list
also names (or an extra HDF5 shard that a glob picks up) trains on test data silently, and the scores lie."""

import json
import logging
import shutil

import numpy as np
import pytest
from test_segmentation import voc_root  # noqa: F401  (a fixture: the VOC release in its official layout)

from attention.errors import UserError
from datamodules import VOC, ModelNet40, ShapeNetPart, ShapeNetPartH5
from datamodules.partseg.shapenet import H5_FOLDER, TXT_FOLDER
from datamodules.points.modelnet40 import HDF5_FOLDER

# ---------------------------------------------------------------------------
# VOC: ImageSets/Segmentation/*.txt, one image id a line


def voc_lists(root):
    return root / "VOCdevkit" / "VOC2012" / "ImageSets" / "Segmentation"


def test_voc_trainaug_list_with_val_ids_is_refused(voc_root):  # noqa: F811
    root, _ = voc_root
    lists = voc_lists(root)
    folder = lists.parent.parent
    # an SBD-derived list built from SBD train + val without removing the VOC2012 val ids, masks and all
    with open(lists / "trainaug.txt", "a") as f:
        f.write("2007_000033\n2007_000011\n")
    for id_ in ("2007_000033", "2007_000011"):
        shutil.copy(folder / "SegmentationClass" / f"{id_}.png", folder / "SegmentationClassAug" / f"{id_}.png")
    with pytest.raises(UserError) as err:
        VOC(str(root), aug=True).setup()
    message = str(err.value)
    assert str(lists / "trainaug.txt") in message and str(lists / "val.txt") in message
    assert "share 2 id(s): 2007_000033; 2007_000011" in message
    assert "Remove the VOC2012 val ids from" in message and "10,582" in message
    VOC(str(root), aug=False).setup()  # train.txt is still disjoint from val.txt: the plain split runs


def test_voc_train_list_overlap_and_repeated_ids_are_refused(voc_root):  # noqa: F811
    root, _ = voc_root
    lists = voc_lists(root)
    train = (lists / "train.txt").read_text()
    extra = [f"2099_{i:06d}" for i in range(7)]  # more shared ids than a message lists
    (lists / "val.txt").write_text((lists / "val.txt").read_text() + "".join(f"{i}\n" for i in extra))
    (lists / "train.txt").write_text(train + "2007_000033\n" + "".join(f"{i}\n" for i in extra))
    with pytest.raises(UserError, match=r"train\.txt and .*val\.txt share 8 id\(s\): 2007_000033; 2099_000000; "
                                        r"2099_000001; 2099_000002; 2099_000003; \.\.\. \(8 in all\)"):
        VOC(str(root)).setup()
    (lists / "train.txt").write_text(train + "2007_000039\n")
    with pytest.raises(UserError) as err:
        VOC(str(root)).setup()
    assert f"{lists / 'train.txt'} lists 1 id(s) more than once: 2007_000039" in str(err.value)


def test_voc_utf16_list_names_the_file(voc_root):  # noqa: F811
    root, _ = voc_root
    lists = voc_lists(root)
    ids = (lists / "train.txt").read_text().split()
    (lists / "train.txt").write_text("\r\n".join(ids) + "\r\n", encoding="utf-16")  # Notepad's "Unicode"
    with pytest.raises(UserError) as err:
        VOC(str(root)).setup()
    message = str(err.value)
    assert str(lists / "train.txt") in message and "must be UTF-8 text, one image id a line" in message
    assert "UTF-16" in message
    (lists / "train.txt").write_text("\n".join(ids) + "\n", encoding="utf-8-sig")  # UTF-8 with a BOM is UTF-8
    dm = VOC(str(root))
    dm.setup()
    assert [p[0].stem for p in dm.train_set.source.pairs] == ids


def test_voc_deeplab_list_lines_are_refused(voc_root):  # noqa: F811
    root, _ = voc_root
    lists = voc_lists(root)
    ids = (lists / "trainaug.txt").read_text().split()
    lines = [f"/JPEGImages/{i}.jpg /SegmentationClassAug/{i}.png" for i in ids]
    (lists / "trainaug.txt").write_text("\n\n" + "\n".join(lines) + "\n")
    with pytest.raises(UserError) as err:
        VOC(str(root), aug=True).setup()
    message = str(err.value)
    assert f"{lists / 'trainaug.txt'}, line 3: {lines[0]!r}" in message
    assert "one image id per line (e.g. 2007_000032)" in message and "does not exist" not in message


# ---------------------------------------------------------------------------
# ShapeNet part, txt release: train_test_split/shuffled_{train,val,test}_file_list.json


def split_list(root, split):
    return root / TXT_FOLDER / "train_test_split" / f"shuffled_{split}_file_list.json"


@pytest.fixture
def txt(tmp_path, shapenet_txt_release):
    return tmp_path, shapenet_txt_release(tmp_path / TXT_FOLDER)


def test_shapenet_lists_that_share_shapes_are_refused(txt):
    root, _ = txt
    train, test = (json.loads(split_list(root, s).read_text()) for s in ("train", "test"))
    split_list(root, "train").write_text(json.dumps(train + test[:2]))
    with pytest.raises(UserError) as err:
        ShapeNetPart(root=str(root), npoints=16).prepare_data()
    message = str(err.value)
    assert f"{split_list(root, 'train')} and {split_list(root, 'test')} share 2 shape(s)" in message
    assert f"{test[0]}; {test[1]}" in message and "must be disjoint" in message
    assert not (root / "processed").exists()  # refused before anything was parsed


def test_shapenet_list_naming_a_shape_twice_is_refused(txt):
    root, _ = txt
    val = json.loads(split_list(root, "val").read_text())
    split_list(root, "val").write_text(json.dumps(val + val[:1]))
    with pytest.raises(UserError) as err:
        ShapeNetPart(root=str(root), npoints=16).setup()
    assert f"{split_list(root, 'val')} names 1 shape(s) more than once: {val[0]}" in str(err.value)


# ---------------------------------------------------------------------------
# HDF5 releases: their file lists decide which files are read


def write_lists(folder, files: dict[str, list[str]], prefix=""):
    for name, listed in files.items():
        (folder / name).write_text("".join(f"{prefix}{f}\n" for f in listed))


def test_modelnet_lists_decide_and_stray_shards_are_named(tmp_path, modelnet_release, caplog):
    folder = tmp_path / HDF5_FOLDER
    written = modelnet_release(folder, train_sizes=(3, 2), test_sizes=(2,), points=32)
    shutil.copy(folder / "ply_data_train0.h5", folder / "ply_data_train0 (1).h5")  # unzipped twice
    shutil.copy(folder / "ply_data_test0.h5", folder / "ply_data_train2.h5")  # a test shard under a train name
    write_lists(folder, {"train_files.txt": ["ply_data_train0.h5", "ply_data_train1.h5"],
                         "test_files.txt": ["ply_data_test0.h5"]}, prefix=f"data/{HDF5_FOLDER}/")
    dm = ModelNet40(root=str(tmp_path), npoints=32, augment=False)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    np.testing.assert_array_equal(dm.train_set.source.labels, written["train"][1])
    for i in range(5):  # train0 then train1, nothing else
        np.testing.assert_array_equal(dm.train_set[i]["points"].numpy(), written["train"][0][i])
    assert len(dm.test_set) == 2
    assert "ply_data_train0 (1).h5; ply_data_train2.h5" in caplog.text and "not read" in caplog.text
    for name in ("train_files.txt", "test_files.txt"):  # without the lists: every ply_data_<split>*.h5, as before
        (folder / name).unlink()
    glob = ModelNet40(root=str(tmp_path), npoints=32)
    glob.setup()
    assert len(glob.train_set) == 5 + 3 + 2


def test_modelnet_shard_in_both_lists_is_refused(tmp_path, modelnet_release):
    folder = tmp_path / HDF5_FOLDER
    modelnet_release(folder, train_sizes=(3, 2), test_sizes=(2,), points=32)
    write_lists(folder, {"train_files.txt": ["ply_data_train0.h5", "ply_data_train1.h5", "ply_data_test0.h5"],
                         "test_files.txt": ["ply_data_test0.h5"]})
    with pytest.raises(UserError) as err:
        ModelNet40(root=str(tmp_path), npoints=32).setup()
    message = str(err.value)
    assert "1 file(s) in both the train split (train_files.txt) and the test split (test_files.txt)" in message
    assert "ply_data_test0.h5" in message and str(folder) in message and f"{HDF5_FOLDER}.zip" in message
    write_lists(folder, {"train_files.txt": ["ply_data_train0.h5", "ply_data_train1.h5", "ply_data_train1.h5"]})
    with pytest.raises(UserError, match=r"train_files\.txt names 1 file\(s\) more than once: ply_data_train1\.h5"):
        ModelNet40(root=str(tmp_path), npoints=32).setup()


def test_shapenet_h5_lists_decide_and_a_file_in_two_lists_is_refused(tmp_path, shapenet_h5_release, caplog):
    folder = tmp_path / H5_FOLDER
    written = shapenet_h5_release(folder, points=32)
    lists = {f"{s}_hdf5_file_list.txt": sorted(p.name for p in folder.glob(f"ply_data_{s}*.h5"))
             for s in ("train", "val", "test")}
    write_lists(folder, lists)
    shutil.copy(folder / "ply_data_test0.h5", folder / "ply_data_train0 (1).h5")
    shutil.copy(folder / "ply_data_val0.h5", folder / "ply_data_train_val0.h5")
    dm = ShapeNetPartH5(root=str(tmp_path), npoints=32)
    with caplog.at_level(logging.WARNING):
        dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (5, 2, 4)
    np.testing.assert_array_equal(dm.train_set.source.categories, written["train"][1])
    assert "ply_data_train0 (1).h5; ply_data_train_val0.h5" in caplog.text
    write_lists(folder, {"val_hdf5_file_list.txt": ["ply_data_val0.h5", "ply_data_test1.h5"]})
    with pytest.raises(UserError) as err:
        ShapeNetPartH5(root=str(tmp_path), npoints=32).setup()
    message = str(err.value)
    assert "the val split (val_hdf5_file_list.txt) and the test split (test_hdf5_file_list.txt)" in message
    assert ": ply_data_test1.h5." in message


def test_shapenet_lists_are_checked_through_torch_geometric_too(tmp_path, shapenet_txt_release):
    """data=shapenet_part_pyg reads the same lists through PyG, which takes them as they are."""
    from datamodules import ShapeNetPartPyG

    shapenet_txt_release(tmp_path / "raw")
    lists = tmp_path / "raw" / "train_test_split"
    train, test = (json.loads((lists / f"shuffled_{s}_file_list.json").read_text()) for s in ("train", "test"))
    (lists / "shuffled_train_file_list.json").write_text(json.dumps(train + test[:1]))
    with pytest.raises(UserError, match=r"shuffled_train_file_list\.json and .*shuffled_test_file_list\.json share "
                                        r"1 shape\(s\).*must be disjoint.*official"):
        ShapeNetPartPyG(root=str(tmp_path), npoints=16).prepare_data()
    assert not (tmp_path / "processed").exists()  # refused before PyG processed anything


def test_shapenet_category_table_not_in_utf8_is_named(txt):
    """A synsetoffset2category.txt saved as UTF-16 read as 'line 1: expected <Category><TAB><synset>, got ...'."""
    root, _ = txt
    table = root / TXT_FOLDER / "synsetoffset2category.txt"
    table.write_text(table.read_text(), encoding="utf-16")
    with pytest.raises(UserError, match=r"synsetoffset2category\.txt is not UTF-8 text \(it looks like UTF-16"):
        ShapeNetPart(root=str(root), npoints=16).prepare_data()
