"""`draftsmith check`: a good export passes; every planted fault of REFERENCE.md §7 is caught."""

import json

import pytest
import torch

from draftsmith.check import FAULTS, CheckConfig, CheckError, engine_reads, inspect, run
from draftsmith.cli import main
from draftsmith.export import export_sglang, export_vllm

from helpers import tiny_drafter

N = 8  # target layers: our aux outputs (1, 3, 4); SGLang ids [1, 3, 4]; vLLM ids [2, 4, 5]
VD = 100



def export(target8, fmt, out):
    folder, model, hf_config = target8
    drafter = tiny_drafter(model, draft_vocab=VD)
    if fmt == "sglang":
        return export_sglang(drafter, out, hf_config)
    return export_vllm(drafter, out, hf_config, verifier=str(folder))


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_good_export_passes_with_a_live_acceptance(target8, tmp_path, fmt):
    result = inspect(CheckConfig(str(export(target8, fmt, tmp_path / fmt)), str(target8[0])))
    assert result.ok, [f for f in result.findings if f.level != "info"]
    assert 0.0 <= result.first_accept <= 1.0
    assert result.engines["vllm"] == [1, 3, 4]  # both engines feed the outputs the drafter was trained on
    assert result.engines.get("sglang", [1, 3, 4]) == [1, 3, 4]


def test_at_least_eight_distinct_faults_are_planted():
    assert len(FAULTS) >= 8 and len({code for _, _, code in FAULTS.values()}) >= 8


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_planted_fault_is_caught(target8, tmp_path, fault):
    fmt, plant, code = FAULTS[fault]
    folder = export(target8, fmt, tmp_path / "export")
    plant(folder)
    result = inspect(CheckConfig(str(folder), str(target8[0]), live=False))
    codes = {f.code for f in result.errors}
    assert not result.ok and code in codes, (fault, [(f.code, f.message) for f in result.findings])


def test_engine_reads_follow_each_engines_convention():
    # SGLang: eagle_config ids are layer outputs; vLLM: top-level ids are layer inputs (output = id - 1)
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    assert engine_reads(cfg, "eagle3", N) == {"sglang": (1, 3, 4), "vllm": (1, 3, 4)}
    # no ids at all (original EAGLE configs): both engines' defaults, inputs of 2, N//2, N-3
    assert engine_reads({}, "eagle3", N) == {"sglang": (1, 3, 4), "vllm": (1, 3, 4)}


def test_foreign_config_whose_engines_disagree_is_caught(target8, tmp_path):
    folder = export(target8, "sglang", tmp_path / "s")
    c = json.loads((folder / "config.json").read_text())
    del c["draftsmith"]  # a foreign export: nothing records what it was trained on
    c["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # same list in both slots: the engines read different layers
    (folder / "config.json").write_text(json.dumps(c))
    codes = {f.code for f in inspect(CheckConfig(str(folder), str(target8[0]), live=False)).errors}
    assert "aux_disagree" in codes


def test_low_acceptance_threshold_fails_the_live_check(target8, tmp_path):
    folder = export(target8, "sglang", tmp_path / "s")
    result = inspect(CheckConfig(str(folder), str(target8[0]), min_accept=1.0, max_new_tokens=8))
    assert result.first_accept < 1.0 and "low_acceptance" in {f.code for f in result.errors}


def test_run_raises_with_every_error_and_the_cli_exits_nonzero(target8, tmp_path, capsys):
    folder = export(target8, "sglang", tmp_path / "s")
    FAULTS["d2t_all_zero"][1](folder)
    FAULTS["missing_key"][1](folder)
    with pytest.raises(CheckError, match=r"(?s)missing_key.*d2t_zero") as e:
        run(CheckConfig(str(folder), str(target8[0]), live=False))
    assert not e.value.result.ok
    assert not run(CheckConfig(str(folder), str(target8[0]), live=False, raise_on_failure=False)).ok
    assert main(["check", "--draft", str(folder), "--target", str(target8[0]), "--no-live"]) == 1
    assert "d2t is all zeros" in capsys.readouterr().err


def test_cli_passes_a_good_export(target8, tmp_path, capsys):
    folder = export(target8, "vllm", tmp_path / "v")
    assert main(["check", "--draft", str(folder), "--target", str(target8[0]), "--max-new-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] is True and out["layout"] == "speculators"
    assert torch.tensor(out["first_accept"]).item() >= 0.0
