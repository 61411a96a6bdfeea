"""The few-row kernel choices made in one process are kept on disk for later processes on the machine
(`dart_hf.calibration.load_kernel_choices` / `save_kernel_choices`), and a damaged file never fails a call."""

from __future__ import annotations

import warnings

import pytest
import torch

import dart_hf
from dart_core import ModelFreeDrafter, TreeConfig
from dart_hf import calibration
from dart_runtime import matmul
from helpers.hf_models import tiny_target

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])
TREE = TreeConfig(remain_total=8, context_depth=8)


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """A new process as far as kernel choices go: none in memory, none adopted yet, an empty cache; returns the
    list of the choice keys whose products tried both kernels from here on."""
    monkeypatch.setenv("DART_SPEC_CACHE", str(tmp_path))
    measured = []
    original = matmul.trial_product

    def counting(x, weight, bias, rows):
        measured.append(matmul.choice_key(weight, rows))
        return original(x, weight, bias, rows)

    monkeypatch.setattr(matmul, "trial_product", counting)

    def restart():
        monkeypatch.setattr(matmul, "_CHOICES", {})
        monkeypatch.setattr(matmul, "_TRIALS", {})
        monkeypatch.setattr(calibration, "_KERNELS", {"loaded": False, "saved": 0})
        measured.clear()

    restart()
    return measured, restart


def decode(model):
    return model.generate(PROMPT, max_new_tokens=24, do_sample=False, dart_head=ModelFreeDrafter(),
                          dart_tree_config=TREE, dart_store=False)


def test_a_later_process_adopts_the_choices_and_measures_nothing(fresh_process):
    measured, restart = fresh_process
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert torch.equal(decode(model), plain) and measured  # trees of several rows: kernels tried here
    decided = set(matmul.kernel_choices())
    assert decided and calibration.kernel_choices_path().is_file()
    restart()
    assert torch.equal(decode(model), plain) and not decided & set(measured)  # adopted from the file
    assert decided <= set(matmul.kernel_choices())


@pytest.mark.parametrize("damage", ["not json {", "[" * 50000, '{"version": 2, "choices": {"k": "yes"}}',
                                    '{"version": 1, "choices": {}}', '{"version": 2, "choices": [1]}'])
def test_a_damaged_choice_file_is_ignored_with_one_warning_and_replaced(fresh_process, damage):
    measured, restart = fresh_process
    model = dart_hf.enable(tiny_target(), False)
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    path = calibration.kernel_choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(damage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = decode(model)
    assert torch.equal(out, plain) and measured
    assert [str(w.message) for w in caught if w.category is dart_hf.DartCacheWarning][0].startswith("ignoring the "
                                                                                                    "kernel choices")
    assert len([w for w in caught if w.category is dart_hf.DartCacheWarning]) == 1
    restart()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dart_hf.DartCacheWarning)
        saved = set(calibration.read_cache_file(path)["choices"])  # the file was replaced by valid choices
        assert torch.equal(decode(model), plain) and saved and not set(measured) & saved  # which are adopted
