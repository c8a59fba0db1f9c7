import json
import subprocess
import sys

import unimp
from unimp.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"unimp {unimp.__version__}"


def test_info_json_lists_every_backend(capsys):
    assert main(["info", "--json", "--no-devices"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["backend"] for b in data["backends"]][:3] == ["torch", "tensorflow", "jax"]
    for b in data["backends"]:
        assert b["installed"] == (b["backend"] in unimp.available_backends())
        assert b["install"].startswith('pip install "unimp[')


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "unimp.cli", "info", "--no-devices"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("unimp ")


def test_no_command_is_usage_error(capsys):
    assert main([]) == 2
