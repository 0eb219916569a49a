from __future__ import annotations

from pathlib import Path

from kvjax.cli import main

ROOT = Path(__file__).parent.parent


def test_generate_prints_tokens_timings_and_cache_usage(capsys):
    assert main(["generate", str(ROOT / "configs/tiny.toml"),
                 "--set", "generate.max_new_tokens=5"]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens: [") == 2
    assert "pages used" in out
    assert "tokens/s" in out


def test_config_error_names_the_key(capsys):
    assert main(["generate", str(ROOT / "configs/tiny.toml"), "--set", "model.nope=1"]) == 2
    assert "model.nope: unknown key" in capsys.readouterr().err


def test_memory_command(capsys):
    assert main(["memory", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "131,072 B" in out
    assert "2.00 MiB" in out
    assert "bandwidth-bound" in out
    assert main(["memory", "--config", str(ROOT / "configs/bench.toml"), "--batch", "8",
                 "--context", "2048"]) == 0
    assert "8 layers, d_model 512" in capsys.readouterr().out
