"""`aerie bench` and `python -m pipelines.benchmark`: the flags of the contract, errors by field."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from aerie.cli import app


def test_help_names_the_contract_flags_and_the_default_sweep_time():
    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--target", "--head", "--prompts", "--concurrency", "--k", "--out", "--requests", "--max-tokens",
                 "--peers", "--incumbent", "--expected-concurrency", "--sla-p99-tpot-ms", "--num-gpus"):
        assert flag in result.output, flag
    assert "minutes" in result.output and "2 CPU cores" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--k", "2,x"], "'x' is not an integer"),
    (["--k", "0,auto"], "k: K must be >= 1 or 'auto', got 0"),
    (["--head", "eagle3"], "expected METHOD=VALUE"),
    (["--concurrency", "1,4", "--expected-concurrency", "2"], "expected_concurrency 2 is not one of"),
])
def test_bad_flags_fail_before_ray_starts_and_name_the_field(args, message):
    base = ["bench", "--target", "t", "--prompts", "p", "--out", "o"]
    result = CliRunner().invoke(app, base + args, env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_missing_fields_are_named():
    result = CliRunner().invoke(app, ["bench", "--target", "t"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "prompts: Field required" in result.output and "out: Field required" in result.output


def test_the_module_entry_point_takes_the_same_flags(capsys):
    from pipelines.benchmark import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "python -m pipelines.benchmark" in capsys.readouterr().out
