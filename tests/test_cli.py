import json

import pytest

from draftsmith.cli import STAGES, build_parser, main


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_has_help(stage, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([stage, "--help"])
    assert e.value.code == 0
    assert "--" in capsys.readouterr().out


def test_a_flags_help_is_its_config_fields_comment(capsys):
    """The comment on a config field's line, with the comment lines that continue it, is its flag's help."""
    for stage, flag, words in (("train", "--draft-intermediate-size", "MLP width; None: the target's (SGLang and vLLM"
                                " read it from the exported config) (default: None)"),
                               ("bench", "--tree-draws", "top | sample | auto")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([stage, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert words in text.split(flag, 2)[2], (stage, flag)


def test_flags_become_the_stage_config(tiny_target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "hi there"}) + "\n")
    code = main(["generate", "--target", str(tiny_target_dir), "--prompts", str(prompts), "--out", str(tmp_path / "g"),
                 "--max-new-tokens", "4", "--batch-size", "2"])
    assert code == 0
    cfg = json.loads((tmp_path / "g" / "generate_config.json").read_text())
    assert cfg["max_new_tokens"] == 4 and cfg["prompts"] == [str(prompts)]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["written"] == 1


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert main(["extract", "--target", str(tmp_path / "missing"), "--data", "x", "--out", "y"]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["train", "--target", "t", "--data", "d", "--out", "o", "--ttt-depth", "0"]) == 2
    assert "ttt_depth" in capsys.readouterr().err
