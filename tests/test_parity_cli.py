"""`python -m parity_tests`: options, JSON output, verdict and exit status."""

import json

import pytest

from parity_tests.__main__ import main


def test_json_report_of_one_scenario_on_both_backends(tmp_path, capsys):
    out = tmp_path / "parity.json"
    status = main(["--scenario", "pp1dp1cp1tp1-pertoken", "--json", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert status == 0
    assert text.strip().splitlines()[-1].startswith("PARITY: all 2 scenarios")
    rows = json.loads(out.read_text())
    assert [r["scenario"] for r in rows] == ["pp1dp1cp1tp1-pertoken", "pp1dp1cp1tp1-pertoken-zero"]
    for row in rows:
        assert row["ok"] and row["failures"] == {"torch": [], "jax": []}
        # world of one: only the per-token scale touches gradients, exactly.
        assert row["steps"]["torch"] == {"token_scale": {"ok": True, "max_abs_diff": 0.0}}
        assert row["steps"]["jax"] == {"token_scale": {"ok": True, "max_abs_diff": 0.0}}
        assert row["jax_compile_seconds"] is not None


def test_mesh_filter_and_list(capsys):
    assert main(["--mesh", "1,8,1,1", "--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names and all(n.startswith("pp1dp8cp1tp1-") or n == "(world" or n == "8)" for n in names)


@pytest.mark.parametrize("argv", [["--mesh", "2,2"], ["--mesh", "a,b,c,d"]])
def test_bad_mesh_is_rejected(argv):
    with pytest.raises(SystemExit, match="--mesh"):
        main(argv)


def test_no_match_exits_2(capsys):
    assert main(["--scenario", "no-such-scenario"]) == 2
    assert "no scenario" in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for option in ("--mesh", "--scenario", "--json", "--backend", "--no-progress", "--summary-only"):
        assert option in text
