"""The training config: YAML + flags, errors that name the field, the two command lines (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aerie.cli import app
from train_jobs.config import ConfigError, FitConfig, load_config, parse_sets
from train_jobs.fit_heads import main

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"data": "d", "target": "t", "method": "eagle3", "out": "o"}


def test_bad_fields_are_named():
    with pytest.raises(ConfigError) as err:
        load_config(**{**REQUIRED, "method": "eagle4", "batch_size": 0, "lr": -1.0, "storage": "gs://x"})
    text = str(err.value)
    assert "method (--method)" in text and "'eagle3', 'peagle' or 'eagle'" in text
    assert "batch_size (--batch-size)" in text
    assert "lr (--lr)" in text
    assert "storage (--storage)" in text and "s3://" in text


def test_missing_and_unknown_fields():
    with pytest.raises(ConfigError) as err:
        load_config(epochs=2, bogus=1)
    text = str(err.value)
    for name in ("data (--data)", "target (--target)", "method (--method)", "out (--out)"):
        assert f"{name}: Field required" in text
    assert "bogus: unknown field" in text


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: /d\ntarget: /t\nmethod: peagle\nout: /o\nepochs: 3\nlr: 0.01\nbetas: [0.8, 0.9]\n")
    cfg = load_config(str(path), epochs=5, workers=None)
    assert (cfg.method, cfg.epochs, cfg.lr, cfg.betas, cfg.workers) == ("peagle", 5, 0.01, (0.8, 0.9), 2)
    path.write_text("data: /d\ntarget: /t\nmethod: eagle\nout: /o\npeagle-ratio-min: 0.9\n")
    with pytest.raises(ConfigError, match="peagle_ratio_min must not exceed peagle_ratio"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="peagle_passes > 1 needs peagle_fed_ratio > 0"):
        load_config(**REQUIRED, peagle_passes=3)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_run_name_is_stable_and_paths_absolute():
    a = load_config(**REQUIRED)
    assert a.run_name == load_config(**REQUIRED).run_name  # the same command resumes the same run
    assert a.run_name != load_config(**{**REQUIRED, "method": "peagle"}).run_name
    assert load_config(**REQUIRED, name="my-run").run_name == "my-run"
    with pytest.raises(ConfigError, match="name"):
        load_config(**REQUIRED, name="../escape")
    absolute = a.with_absolute_paths()
    assert Path(absolute.data).is_absolute() and absolute.data.endswith("/d")
    s3 = load_config(**{**REQUIRED, "out": "s3://bucket/heads/x"}).with_absolute_paths()
    assert s3.out == "s3://bucket/heads/x"


def test_train_config_mapping():
    tc = load_config(**REQUIRED, k=4, ttt_steps=5, batch_size=3, seed=9).train_config()
    assert (tc.eval_depth, tc.ttt_steps, tc.batch_size, tc.seed) == (4, 5, 3, 9)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("train_*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, FitConfig)


def test_aerie_train_names_the_bad_flag():
    result = CliRunner().invoke(
        app, ["train", "--data", "d", "--target", "t", "--method", "medusa", "--out", "o", "--workers", "0"]
    )
    assert result.exit_code == 2, result.output
    assert "method (--method)" in result.output and "workers (--workers)" in result.output


def test_aerie_train_help_lists_the_flags():
    result = CliRunner().invoke(app, ["train", "--help"])
    assert result.exit_code == 0
    for name in ("--data", "--target", "--method", "--out", "--workers", "--epochs", "--warm-start", "--config",
                 "--name", "--storage", "--set"):
        assert name in result.output


def test_module_entry_point_names_the_bad_field(capsys):
    code = main(["--data", "d", "--target", "t", "--method", "eagle3", "--out", "o", "--batch-size", "zero"])
    assert code == 2
    assert "batch_size (--batch-size)" in capsys.readouterr().err
    assert parse_sets(["checkpoint-every=5", "use_gpu=true", "name=007"]) == {
        "checkpoint_every": 5, "use_gpu": True, "name": "007"
    }


def test_module_entry_point_flags(monkeypatch):
    import train_jobs.fit_heads as fit_heads

    seen = {}
    monkeypatch.setattr(fit_heads, "cli_run", lambda config, overrides: seen.update(config=config, **overrides) or 0)
    assert main(["--config", "c.yaml", "--data", "d", "--workers", "3", "--use-gpu", "--no-progress",
                 "--betas", "[0.8, 0.9]", "--set", "seed=4"]) == 0
    assert seen == {"config": "c.yaml", "data": "d", "workers": 3, "use_gpu": True, "progress": False,
                    "betas": [0.8, 0.9], "seed": 4}
