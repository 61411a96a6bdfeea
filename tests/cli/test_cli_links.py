"""`dart-spec calibrate` rewrites HEAD/config.json in place: a config.json that is a link (a Hugging Face cache
snapshot's files are symbolic links into its blob store) is refused before any work, with the reason, and stays the
link it was; a regular file gets the curve, through a linked directory too."""

import json
import os

import pytest

import dart_train.trainer
import dart_hf.calibration
from dart_cli.main import main
from dart_core import AcceptanceCurve
from dart_core.config import ACCEPTANCE_KEY
from helpers.hf_models import char_tokenizer, random_head, tiny_target

CURVE = AcceptanceCurve({1: 1.5, 2: 1.8}, steps=3, new_tokens=5, prompts=1, target="tiny")


@pytest.fixture
def calls(monkeypatch):
    """The target loader and the measurement stubbed (the command's file handling is what is tested)."""
    made = []

    def load_target(name, device, with_tokenizer=False):
        made.append(name)
        return tiny_target(), char_tokenizer()

    monkeypatch.setattr(dart_train.trainer, "load_target", load_target)
    monkeypatch.setattr(dart_hf.calibration, "measure_acceptance", lambda *a, **k: CURVE)
    return made


def head_dir(path):
    random_head(tiny_target()).save_pretrained(path)
    return path


def snapshot(tmp_path, relative=True):
    """A Hugging Face cache layout: blobs/<hash> files, snapshots/<rev>/<name> links to them."""
    real = head_dir(tmp_path / "real")
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for name in os.listdir(real):
        blob = blobs / f"hash-{name}"
        os.replace(real / name, blob)
        os.symlink(os.path.relpath(blob, snap) if relative else blob, snap / name)
    return snap, blobs / "hash-config.json"


@pytest.mark.parametrize("relative", [True, False], ids=["relative link", "absolute link"])
def test_a_linked_config_is_refused_before_any_work_and_stays_a_link(tmp_path, calls, capsys, relative):
    snap, blob = snapshot(tmp_path, relative)
    before = blob.read_text()
    assert main(["calibrate", str(snap), "--target", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "config.json is a symbolic link" in err and "cp -rL" in err
    assert os.path.islink(snap / "config.json") and blob.read_text() == before
    assert calls == []  # refused before the target loads


def test_a_hard_linked_config_is_refused(tmp_path, calls, capsys):
    head = head_dir(tmp_path / "head")
    os.link(head / "config.json", tmp_path / "other.json")
    before = (tmp_path / "other.json").read_text()
    assert main(["calibrate", str(head), "--target", "tiny"]) == 2
    assert "other hard link" in capsys.readouterr().err
    assert os.path.samefile(head / "config.json", tmp_path / "other.json")
    assert (tmp_path / "other.json").read_text() == before


@pytest.mark.parametrize("linked_directory", [False, True], ids=["directory", "linked directory"])
def test_a_regular_config_gets_the_curve(tmp_path, calls, linked_directory):
    head = head_dir(tmp_path / "head")
    given = head
    if linked_directory:
        given = tmp_path / "link"
        os.symlink(head, given)
    assert main(["calibrate", str(given), "--target", "tiny"]) == 0
    assert json.loads((head / "config.json").read_text())[ACCEPTANCE_KEY]["tau"] == {"1": 1.5, "2": 1.8}
    assert os.path.islink(given) == linked_directory and not os.path.islink(head / "config.json")
