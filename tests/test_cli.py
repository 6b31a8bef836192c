import subprocess
import sys

from pdbridge import cli


def test_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0

    out = capsys.readouterr().out
    assert "run" in out
    assert "console" in out


def test_unknown_command_exits_2(capsys):
    assert cli.main(["frobnicate"]) == 2

    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_run_check_prepares_embedded_console_and_prints_url(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PDBRIDGE_VAR_DIR": str(tmp_path), "HOME": str(tmp_path)}

    result = subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "run", "--check", "--port", "8765"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert "pdbridge console: http://127.0.0.1:8765/" in result.stdout
    assert "admin account created" in result.stdout
    assert (tmp_path / "pdbridge.sqlite3").exists()
