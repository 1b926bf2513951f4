"""Every rejection is one line naming the key, the value and what is allowed; exit code 2; no traceback."""
from __future__ import annotations

import textwrap

import pytest

from colorl.cli import main

CASES = [
    # (override, words the one-line message must contain)
    (["rollout.group_size=1"], ["rollout.group_size", "1", ">= 2"]),
    (["rollout.enigne=hf"], ["rollout.enigne", "did you mean", "rollout.engine"]),
    (["trian.lr=1e-5"], ["trian", "did you mean", "train"]),
    (["rollout.engine=vllm"], ["rollout.engine", "vllm", "can run", "'native', 'hf'"]),
    (["task.name=chess"], ["task.name", "chess", "arithmetic"]),
    (["mode=sideways"], ["mode", "sideways", "colocated"]),
    (["staleness.max=-1"], ["staleness.max", "-1", ">= 0"]),
    (["train.lr=fast"], ["train.lr", "fast", "number"]),
    (["rollout.temperature=0"], ["rollout.temperature", "> 0"]),
    (["rollout.top_p=1.5"], ["rollout.top_p", "<= 1"]),
    (["launch.nproc=3"], ["rollout.batch_groups=4", "launch.nproc=3", "divisible"]),
    (["task.name=jsonl"], ["task.path", "required"]),
    (["model.path=/no/such/model"], ["model.path", "/no/such/model"]),
    (["task.reward=no_such_module_xyz:score"], ["task.reward", "no_such_module_xyz", "cannot import"]),
    (["task.reward=json:no_such_function"], ["task.reward", "no_such_function"]),
    (["task.reward=nocolon"], ["task.reward", "module:function"]),
    (["task.path=/no/such.jsonl", "task.name=jsonl"], ["task.path", "not found"]),
    (["task.options={digits: 9}"], ["task.options.digits", "9"]),
    (["task.options={colour: red}"], ["task.options.colour", "unknown"]),
    (["task.options={eval_fraction: 1.0}"], ["task.options.eval_fraction", "0 < x < 1"]),
    (["rollout"], ["key=value"]),
    (["model.lora=8"], ["model.lora=8", "is a section", "--set 'model.lora={r: 8, alpha: 16.0}'"]),
    (["run.steps.x=1"], ["run.steps", "not a section"]),
    (["rollout.engine=sglang", "launch.device=cpu"], ["sglang", "CUDA"]),
    (["task.env=chess"], ["task.env", "chess", "calculator"]),
    (["task.env=calculator", "task.reward=reward_fns:digit_fraction"], ["task.reward", "environment gives"]),
    (["task.env_options={latency: 1}"], ["task.env_options", "task.env"]),
    (["task.env=calculator", "task.env_options={colour: red}"], ["task.env_options", "colour", "CalculatorEnv"]),
    (["task.env=calculator", "rollout.length_override={mean: 8, tailness: 50, cap: 16}"],
     ["rollout.length_override", "multi-turn"]),
]


def run_cli(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("overrides, words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_rejections_are_one_line_with_exit_2(capsys, overrides, words):
    argv = ["train", "configs/tiny.yaml", "--dry-run"]
    for item in overrides:
        argv += ["--set", item]
    code, out, err = run_cli(capsys, argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_set_given_key_and_value_as_two_words_says_how(capsys):
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--set", "run.steps", "3", "--dry-run"])
    assert code == 2 and err.strip() == ("colorl: error: --set run.steps: --set takes KEY=VALUE in one word, "
                                         "e.g. --set run.steps=... (see colorl --help)")


def test_dry_run_names_the_device_it_will_run_on(capsys):
    code, out, _ = run_cli(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", "launch.device=auto"])
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("# launch:")]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert line == f"# launch: 1 x {device} (launch.device: auto)"


def test_missing_file(capsys):
    code, _, err = run_cli(capsys, ["train", "no/such/config.yaml"])
    assert code == 2 and "config file not found" in err and len(err.strip().splitlines()) == 1


def test_unreadable_yaml(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {name: x\nmodel: [")
    code, _, err = run_cli(capsys, ["train", str(bad)])
    assert code == 2 and "not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_top_level_not_a_mapping(capsys, tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    code, _, err = run_cli(capsys, ["train", str(bad)])
    assert code == 2 and "mapping" in err


def test_dry_run_prints_resolved_config_and_whole_sections(capsys):
    code, out, _ = run_cli(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set",
                                    "rollout.length_override={mean: 64, tailness: 90, cap: 512}",
                                    "--set", "train.lr=3e-4"])
    assert code == 0
    assert "tailness: 90" in out and "lr: 0.0003" in out


def test_every_shipped_config_validates(capsys):
    import glob

    for path in sorted(glob.glob("configs/*.yaml")):
        code, _, err = run_cli(capsys, ["train", path, "--dry-run"])
        assert code == 0, (path, err)


def test_resume_without_checkpoint_is_refused(capsys, tmp_path):
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "r"), "--resume"])
    assert code == 2 and "no complete checkpoint" in err


def test_existing_run_is_never_overwritten(capsys, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--run-dir", str(run)])
    assert code == 2 and "already holds a run" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_user_reward_module_loads(tmp_path, monkeypatch):
    from colorl.config import load_config
    from colorl.preflight import check_user_code

    (tmp_path / "my_reward.py").write_text(textwrap.dedent("""
        def score(prompt, completion, answer):
            return 1.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config("configs/tiny.yaml", ["task.reward=my_reward:score"])
    check_user_code(cfg)
    assert cfg.task.reward == "my_reward:score"


def test_the_config_imports_no_user_code_resolution():
    """The config is data every layer reads: resolving rewards and environments is preflight's job, so
    config.py imports neither colorl.envs nor colorl.tasks (a circle config -> envs -> tasks -> config)."""
    import ast
    import inspect

    import colorl.config

    tree = ast.parse(inspect.getsource(colorl.config))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m.startswith(("colorl.envs", "colorl.tasks", "colorl.user_code"))}


def test_bad_cli_flag_exits_2(capsys):
    assert main(["train", "configs/tiny.yaml", "--no-such-flag"]) == 2


def test_broken_or_unsupported_model_folders(capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", f"model.path={broken}"])
    assert code == 2 and "unreadable model config" in err and len(err.strip().splitlines()) == 1
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", f"model.path={gpt2}"])
    assert code == 2 and "gpt2" in err and "rollout.engine=hf" in err and len(err.strip().splitlines()) == 1
    # the hf engine takes any family; this folder then fails the launch's next check (no tokenizer), in --dry-run too
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--dry-run", "--set", f"model.path={gpt2}",
                                    "--set", "rollout.engine=hf"])
    assert code == 2 and "cannot build a chat prompt" in err and len(err.strip().splitlines()) == 1


def test_model_without_chat_template_is_refused_before_launch(capsys, tmp_path):
    from colorl.models import save_tiny_model

    folder = save_tiny_model(tmp_path / "no-template")
    (folder / "chat_template.jinja").unlink()
    config = folder / "tokenizer_config.json"
    import json

    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--run-dir", str(tmp_path / "run"),
                                    "--set", f"model.path={folder}"])
    assert code == 2 and "cannot build a chat prompt" in err and len(err.strip().splitlines()) == 1


def test_a_failed_start_leaves_a_directory_a_fresh_run_can_use(capsys, tmp_path):
    from colorl.config import load_config
    from colorl.worker import prepare_run_dir

    run = tmp_path / "run"
    prepare_run_dir(load_config("configs/tiny.yaml", ["run.seed=1"]), run, resume=False)
    prepare_run_dir(load_config("configs/tiny.yaml", ["run.seed=2"]), run, resume=False)
    assert "seed: 2" in (run / "config.yaml").read_text()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # crashed before its first checkpoint
    code, _, err = run_cli(capsys, ["train", "configs/tiny.yaml", "--run-dir", str(run)])
    assert code == 2 and "no checkpoint to resume from" in err
